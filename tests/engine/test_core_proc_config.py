"""The engine-core process loads its model config without importing torchvision and sklearn
(`core_proc.unused_imports_hidden`): transformers' config modules import them when installed
(torchvision imports torch._dynamo), seconds of every server start (BENCHMARKS.md, issue 20).

Neither is installed here: stand-in packages record their import in a file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SHARED = Path(__file__).resolve().parents[3] / "shared"
MODEL = _SHARED / "models" / "tinystories-656k"

# Enough of torchvision's names for transformers' image utilities to import.
_STAND_IN = """
class _Any:
    def __getattr__(self, name): return self
    def __call__(self, *args, **kwargs): return self
def __getattr__(name): return _Any()
"""


def _stand_in(root: Path) -> Path:
    for name, subs in (("torchvision", ("transforms", "io")), ("sklearn", ("metrics",))):
        package = root / name
        for sub in ("", *subs):
            (package / sub).mkdir(parents=True, exist_ok=True)
            (package / sub / "__init__.py").write_text(_STAND_IN)
        (package / "__init__.py").write_text(
            f'import os\nopen(os.environ["MARKER"], "a").write("{name}\\n")\n'
            '__version__ = "0.99.0"\n' + _STAND_IN
        )
    (root / "torchvision" / "transforms" / "functional.py").write_text(_STAND_IN)
    return root


def _run(code: str, root: Path, marker: Path, **env_vars: str) -> str:
    env = dict(os.environ, MARKER=str(marker), PYTHONPATH=f"{root}{os.pathsep}{Path.cwd()}",
               **env_vars)  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(not MODEL.is_dir(), reason="needs ../shared/models")
def test_the_config_loads_without_torchvision_and_sklearn_which_import_afterwards(
    tmp_path: Path,
) -> None:
    root = _stand_in(tmp_path / "site")
    load = (
        "from pagedserve.engine.model_files import load_hf_config\n"
        f"config = load_hf_config({str(MODEL)!r})\n"
    )
    plain, hidden = tmp_path / "plain", tmp_path / "hidden"
    # Without it, loading the config imports the torchvision stand-in: the test can fail.
    # (transformers imports sklearn only where scipy is installed too: not here.)
    _run(load, root, plain)
    assert "torchvision" in plain.read_text().split()
    out = _run(
        "import sys\nfrom pagedserve.engine.core_proc import unused_imports_hidden\n"
        f"with unused_imports_hidden():\n    {load.replace(chr(10), chr(10) + '    ')}\n"
        "print(type(config).__name__, 'torchvision' in sys.modules, 'sklearn' in sys.modules)\n"
        "import torchvision, sklearn\nprint('after', torchvision.__version__)\n",
        root,
        hidden,
    )
    assert out.split() == ["LlamaConfig", "False", "False", "after", "0.99.0"]
    assert hidden.read_text().split() == ["torchvision", "sklearn"]  # the imports after it


@pytest.mark.skipif(not MODEL.is_dir(), reason="needs ../shared/models")
def test_a_model_folders_own_config_code_may_import_them(tmp_path: Path) -> None:
    """A config of the model folder's own code (`auto_map`, trust_remote_code) that imports
    torchvision loads in the engine core too (`core_proc.engine_config`: again without the
    hiding), as it does in the API server's process; with the hiding alone its import failed
    ("import of torchvision halted; None in sys.modules") and the engine did not start."""
    root = _stand_in(tmp_path / "site")
    folder = tmp_path / "model"
    folder.mkdir()
    for file in MODEL.iterdir():
        (folder / file.name).symlink_to(file)
    config = json.loads((MODEL / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_own.OwnConfig"}
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_own.py").write_text(
        "import torchvision\nfrom transformers import LlamaConfig\n\n\n"
        "class OwnConfig(LlamaConfig):\n    pass\n"
    )
    marker = tmp_path / "marker"
    out = _run(
        "from pagedserve.engine.core_proc import engine_config\n"
        f"config = engine_config({{'model': {str(folder)!r}, 'trust_remote_code': True}})\n"
        "print(type(config.model_config.hf_config).__name__)\n",
        root,
        marker,
        HF_MODULES_CACHE=str(tmp_path / "modules"),
    )
    assert out.split() == ["OwnConfig"]
    assert "torchvision" in marker.read_text().split()


@pytest.mark.skipif(not MODEL.is_dir(), reason="needs ../shared/models")
def test_the_api_server_loads_a_text_models_config_without_them_too(tmp_path: Path) -> None:
    """The API server's process (`engine.server_config`) hides them for a text-only
    model, whose config and tokenizer it loads while the engine core starts (about as long,
    on the H200 host); not for a multimodal one, whose images it processes with
    transformers (torchvision's fast image processors)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    root = _stand_in(tmp_path / "site")
    llava = tmp_path / "llava"
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    LlavaConfig(
        text_config=LlamaConfig.from_pretrained(MODEL),
        vision_config=vision,
        image_token_index=2047,
        architectures=["LlavaForConditionalGeneration"],
    ).save_pretrained(llava)
    for folder, expected in ((MODEL, ["LlamaConfig", "False"]), (llava, ["LlavaConfig", "True"])):
        out = _run(
            "import sys\nfrom pagedserve.engine.arg_utils import EngineArgs\n"
            "from pagedserve.engine.server_config import server_config\n"
            f"args = EngineArgs(model={str(folder)!r}, tokenizer={str(MODEL)!r})\n"
            "config = server_config(args)\n"
            "print(type(config.model_config.hf_config).__name__, 'torchvision' in sys.modules)\n",
            root,
            tmp_path / f"marker_{folder.name}",
        )
        assert out.split() == expected
