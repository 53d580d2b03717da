"""CUDA's driver started on a thread while the process imports torch: through the driver
library directly, without the GIL, on the device the Trainer takes. A fake driver library
(built here with the C compiler) stands in for libcuda."""
import shutil
import subprocess
import threading

import pytest

from distlm.train.cuda_driver import CudaDriverStart, local_rank

FAKE = r"""
#include <stdatomic.h>
static atomic_int go = 0;
static int inits = 0, asked = -1, retained = -1, refuse = 0;
int cuInit(unsigned flags) { while (!atomic_load(&go)) {} inits++; return refuse; }
void release(void) { atomic_store(&go, 1); }
void set_refuse(int rc) { refuse = rc; }
int cuDeviceGet(int *dev, int ordinal) { asked = ordinal; *dev = ordinal + 100; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { retained = dev; *ctx = (void *)1; return 0; }
int state(int i) { return i == 0 ? inits : i == 1 ? asked : retained; }
"""


@pytest.fixture
def fake_driver(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake driver library")
    (tmp_path / "fake.c").write_text(FAKE)
    lib = tmp_path / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(lib), str(tmp_path / "fake.c")], check=True)
    return lib


def test_the_driver_starts_beside_python_and_makes_the_trainers_device_context(fake_driver):
    import ctypes
    start = CudaDriverStart(3, library=str(fake_driver)).start()
    lib = ctypes.CDLL(str(fake_driver))  # the same library object: dlopen shares it
    # cuInit spins until released: this thread runs Python meanwhile, so the call holds no GIL
    assert start.outcome == "running" and lib.state(0) == 0
    waiter = threading.Thread(target=start.join)
    waiter.start()
    lib.release()
    waiter.join()
    assert start.outcome == "done" and start.seconds is not None
    assert (lib.state(0), lib.state(1), lib.state(2)) == (1, 3, 103)  # cuInit once, device 3, its context
    assert start.describe().startswith("cuda driver start ") and "in the background from the imports on (done)" in start.describe()


def test_a_refusing_driver_is_said_and_leaves_the_rest_to_torch(fake_driver):
    import ctypes
    lib = ctypes.CDLL(str(fake_driver))
    lib.set_refuse(100)
    lib.release()
    start = CudaDriverStart(0, library=str(fake_driver)).start()
    start.join()
    assert start.outcome == "cuInit refused (100)" and lib.state(1) == -1  # no device asked for after a refusal
    assert "(cuInit refused (100))" in start.describe()


def test_no_driver_library_says_nothing(tmp_path):
    start = CudaDriverStart(0, library=str(tmp_path / "libnothing.so")).start()
    start.join()
    assert start.outcome.startswith("no CUDA driver") and start.describe() is None


def test_the_device_is_the_trainers_and_a_cpu_run_starts_nothing():
    assert local_rank({}) == 0 and local_rank({"LOCAL_RANK": "2"}) == 2
    assert local_rank({"HOROVOD_LOCAL_RANK": "5"}) == 5 and local_rank({"LOCAL_RANK": "1", "HOROVOD_LOCAL_RANK": "5"}) == 1
    assert CudaDriverStart.for_run("cpu", {"LOCAL_RANK": "1"}) is None
    start = CudaDriverStart.for_run("auto", {"LOCAL_RANK": "1"})
    start.join()
    assert start.device_index == 1
