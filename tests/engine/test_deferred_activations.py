"""Loading a model's config imports none of transformers' modeling code
(`engine.deferred_activations`): with torch installed, transformers' config modules import
`transformers.activations`, which imports `core_model_loading` and torch.distributed.tensor,
2.5 s of the 8B server's start on the H200 host (BENCHMARKS.md, issue 20). The config must
load and check as before, and the activation table must work once it is used.

Each test runs in a fresh interpreter: in this one transformers' modules are imported already."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SHARED = Path(__file__).resolve().parents[3] / "shared"
MODEL = _SHARED / "models" / "tinystories-656k"
HEAVY = ("transformers.activations", "transformers.core_model_loading", "torch.distributed.tensor")


def _run(code: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=f"{Path.cwd()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.skipif(not MODEL.is_dir(), reason="needs ../shared/models")
def test_the_config_loads_without_the_modeling_imports_and_as_before() -> None:
    """load_hf_config leaves out what plain AutoConfig imports (checked too: the test can
    fail), and gives the same config."""
    heavy = f"print(*[name in sys.modules for name in {HEAVY!r}])\n"
    plain = _run(
        "import sys, transformers\n"
        f"c = transformers.AutoConfig.from_pretrained({str(MODEL)!r})\n" + heavy
    )
    assert plain == ["True", "True", "True"]  # transformers still imports them: a real test
    ours = _run(
        "import json, sys\nfrom pagedserve.engine.model_files import load_hf_config\n"
        f"c = load_hf_config({str(MODEL)!r})\n"
        + heavy
        + "print(type(c).__name__, json.dumps(c.to_dict(), sort_keys=True).replace(' ', ''))\n"
        "import transformers\n"
        f"p = transformers.AutoConfig.from_pretrained({str(MODEL)!r})\n"
        "print(p.to_dict() == c.to_dict())\n"
    )
    assert ours[:3] == ["False", "False", "False"]
    assert ours[3] == "LlamaConfig"
    assert json.loads(ours[4])["num_key_value_heads"] == 4
    assert ours[5] == "True"


def test_the_activation_table_loads_on_first_use() -> None:
    """What imports transformers.activations meanwhile (transformers' type validators) gets a
    table that reads the real one when first used, with the same names and values; any other
    name imports the real module; afterwards the module imports normally."""
    out = _run(
        "import sys\nfrom pagedserve.engine.deferred_activations import activations_deferred\n"
        "with activations_deferred():\n"
        "    from transformers.utils import type_validators as tv\n"
        "    print('transformers.activations' in sys.modules and "
        "type(sys.modules['transformers.activations']).__name__)\n"
        "print('transformers.activations' in sys.modules)\n"
        "print('silu' in tv.ACT2FN, 'no_such_activation' in tv.ACT2FN)\n"
        "import transformers.activations as real\n"
        "print(type(tv.ACT2FN['silu']).__name__, sorted(tv.ACT2FN) == sorted(real.ACT2FN),"
        " len(tv.ACT2FN) == len(real.ACT2FN), list(tv.ACT2FN.keys()) == list(real.ACT2FN.keys()))\n"
        "with activations_deferred():\n"
        "    from transformers.activations import get_activation\n"
        "print(get_activation is real.get_activation)\n"
    )
    assert out[:4] == ["_DeferredActivations", "False", "True", "False"]
    assert out[4:] == ["SiLUActivation", "True", "True", "True", "True"]


def test_other_names_of_the_stand_in_import_the_real_module() -> None:
    """A config module that imports another name of transformers.activations while the config
    loads gets the real one (e.g. a model folder's own config code)."""
    out = _run(
        "import sys\nfrom pagedserve.engine.deferred_activations import activations_deferred\n"
        "with activations_deferred():\n"
        "    from transformers.activations import ACT2CLS\n"
        "    print(type(sys.modules['transformers.activations']).__name__)\n"
        "import transformers.activations\nprint(ACT2CLS is transformers.activations.ACT2CLS)\n"
    )
    assert out == ["module", "True"]
