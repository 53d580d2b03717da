"""Every `distlm VERB` body (its argument handling, printing and exit status) is in distlm/cli/;
the packages below hold the library functions the verbs call."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "distlm"


def command_line_bodies(source: str) -> list[str]:
    """Functions that print and return an exit status (annotated ``-> int``). A module that
    is its own script (``python -m distlm.x``, under ``if __name__ == "__main__"``) keeps its
    ``main``: that is another command line than `distlm`'s."""
    tree = ast.parse(source)
    script = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.returns is None:
            continue
        if ast.unparse(node.returns) != "int" or (script and node.name == "main"):
            continue
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
               for n in ast.walk(node)):
            found.append(node.name)
    return found


def test_every_verb_is_defined_in_cli():
    from distlm.cli import VERBS
    elsewhere = {verb: fn.__module__ for verb, fn in VERBS.items() if not fn.__module__.startswith("distlm.cli")}
    assert not elsewhere, elsewhere


def test_no_command_line_body_outside_cli():
    bodies = [f"{p.relative_to(PKG.parent)}: {name}" for p in sorted(PKG.rglob("*.py"))
              if p.relative_to(PKG).parts[0] != "cli" for name in command_line_bodies(p.read_text())]
    assert not bodies, bodies


def test_the_body_reader_finds_a_body_and_spares_a_scripts_main():
    body = "def show(x) -> int:\n    print(x)\n    return 0\n"
    assert command_line_bodies(body) == ["show"]
    assert command_line_bodies(body.replace("print(x)", "x += 1")) == []  # no printing: a library int
    script = "def main(argv) -> int:\n    print(argv)\n    return 0\n\nif __name__ == \"__main__\":\n    main([])\n"
    assert command_line_bodies(script) == []
    assert command_line_bodies(script.replace("def main", "def other")) == ["other"]
