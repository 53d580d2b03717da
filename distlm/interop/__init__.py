"""Interoperability with other ecosystems: Hugging Face ``transformers`` folders.

    export_hf(run_or_ckpt, out_dir)            distlm checkpoint -> GPT2LMHeadModel / LlamaForCausalLM
    apply_hf_model_config(model_cfg, path)     HF folder -> distlm architecture fields
    load_hf_into(gpt, path)                    HF folder -> weights of a built distlm GPT
"""
from distlm.interop.hf import ExportError, InteropError, export_hf
from distlm.interop.hf_load import apply_hf_model_config, load_hf_into, model_config_from_hf

__all__ = ["ExportError", "InteropError", "apply_hf_model_config", "export_hf", "load_hf_into",
           "model_config_from_hf"]
