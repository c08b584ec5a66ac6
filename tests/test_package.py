import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_ember_does_not_import_triton():
    code = "import sys, ember; ember.ops.rmsnorm; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_works_without_triton():
    # A finder that refuses triton simulates macOS/Windows, where it does not exist.
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'triton' or name.startswith('triton.'): raise ImportError('no triton here')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import torch, ember\n"
            "x = torch.randn(2, 8)\n"
            "print(ember.ops.rmsnorm(x, torch.ones(8)).shape, ember.doctor()['families']['norm']['path'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch.Size([2, 8]) reference" in out.stdout


def test_python_m_ember():
    out = subprocess.run([sys.executable, "-m", "ember", "doctor"], capture_output=True, text=True)
    assert out.returncode == 0 and "op families:" in out.stdout


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(c for c in _readme_commands() if "pytest" in c)
    assert test_cmd in ci.splitlines()
