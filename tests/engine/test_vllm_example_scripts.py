"""vLLM's offline example scripts, as of vLLM v0.10.1, run as their users run them, with only their
`vllm` imports changed to `prefixgrove` (the copies are in third_party/vllm_v0_10_1_examples/):
examples/offline_inference/basic/basic.py, basic/generate.py, basic/chat.py,
automatic_prefix_caching.py, prefix_caching.py, reproducibility.py and structured_outputs.py.

The checkpoints they name (facebook/opt-125m, meta-llama/Llama-3.2-1B-Instruct, ...) are not here
and nothing is downloaded: each `LLM(...)` they build loads a tiny random Llama with SmolLM2's
tokenizer and chat template instead, so they run in seconds on the CPU and print nonsense. What is
checked is that every import, call, argument and field they use works, and what they print.

Left out, because they use what is not served (each refused by name: docs/engine-api.md):
basic/classify.py, basic/score.py, basic/reward.py and basic/embed.py (pooling models),
llm_engine_example.py (`LLMEngine.add_request` takes token ids here, not a prompt), and the LoRA,
multimodal, speculative-decoding, data-parallel and profiling examples.
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import SMOLLM2, build_model, smollm2_file

import prefixgrove
from prefixgrove import LLM
from prefixgrove.catalog.presets import load_tokenizer

EXAMPLES = Path(__file__).parent / "third_party" / "vllm_v0_10_1_examples"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama that speaks SmolLM2's tokens and chat template."""
    smollm2_file()
    tokenizer = load_tokenizer(SMOLLM2)
    path = tmp_path_factory.mktemp("example-model")
    model = build_model(
        "llama3",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class Examples:
    """Runs a script as `python script.py ARGS`, its LLMs loading `checkpoint` whatever model they
    name; `built` keeps what each LLM(...) was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, checkpoint: str) -> None:
        self.monkeypatch = monkeypatch
        self.built: list[tuple[str, dict[str, Any]]] = []
        built = self.built

        class ExampleLLM(LLM):
            def __init__(self, model: str, **kwargs: Any) -> None:
                built.append((model, kwargs))
                super().__init__(checkpoint, **kwargs)

        monkeypatch.setattr(prefixgrove, "LLM", ExampleLLM)
        # reproducibility.py sets it; the test leaves the environment as it found it
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)

    def run(self, script: str, *args: str) -> None:
        self.monkeypatch.setattr(sys, "argv", [script, *args])
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch, checkpoint: str) -> Examples:
    return Examples(monkeypatch, checkpoint)


PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def printed(capsys: pytest.CaptureFixture[str], label: str) -> list[str]:
    """The values the script printed after `label`."""
    return re.findall(rf"^{re.escape(label)}\s*(.*)$", capsys.readouterr().out, re.MULTILINE)


def test_basic(examples: Examples, capsys: pytest.CaptureFixture[str]) -> None:
    examples.run("basic.py")
    out = capsys.readouterr().out
    assert re.findall(r"^Prompt:\s+(.*)$", out, re.MULTILINE) == [repr(p) for p in PROMPTS]
    assert len(re.findall(r"^Output:\s+'", out, re.MULTILINE)) == len(PROMPTS)
    assert examples.built == [("facebook/opt-125m", {})]


def test_generate_with_engine_args_flags(
    examples: Examples, capsys: pytest.CaptureFixture[str]
) -> None:
    examples.run("generate.py", "--max_tokens", "5", "--temperature", "0", "--max-num-seqs", "8",
                 "--no-enable-prefix-caching")  # fmt: skip
    assert printed(capsys, "Prompt:") == [repr(p) for p in PROMPTS]
    [(model, kwargs)] = examples.built
    assert model == "meta-llama/Llama-3.2-1B-Instruct"
    assert (kwargs["max_num_seqs"], kwargs["enable_prefix_caching"]) == (8, False)


def test_chat_with_a_chat_template_file(
    examples: Examples, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    examples.run("chat.py", "--max-tokens", "3", "--chat-template-path", str(template))
    prompts = printed(capsys, "Prompt:")
    assert len(prompts) == 11  # one conversation, then a batch of ten
    assert all(p == prompts[0] and p.endswith("<|im_start|>assistant\\n'") for p in prompts)


def test_automatic_prefix_caching(examples: Examples, capsys: pytest.CaptureFixture[str]) -> None:
    examples.run("automatic_prefix_caching.py")
    assert len(printed(capsys, "Generation time:")) == 2
    assert examples.built == [("lmsys/longchat-13b-16k", {"enable_prefix_caching": True})]


def test_prefix_caching_gives_the_answers_computed_without_it(
    examples: Examples, capsys: pytest.CaptureFixture[str]
) -> None:
    examples.run("prefix_caching.py")
    assert printed(capsys, "Generated answers are the same:") == ["True"]


def test_reproducibility(examples: Examples, capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for _ in range(2):
        examples.run("reproducibility.py")
        runs.append(re.findall(r"^Generated text: (.*)$", capsys.readouterr().out, re.MULTILINE))
    assert runs[0] == runs[1] and len(runs[0]) == len(PROMPTS)
    assert [kwargs for _, kwargs in examples.built] == [{"seed": 42}] * 2


def test_structured_outputs_with_guided_decoding_params(
    examples: Examples, capsys: pytest.CaptureFixture[str]
) -> None:
    examples.run("structured_outputs.py")
    out = dict(re.findall(r"^Guided decoding by (\w+): (.*)$", capsys.readouterr().out, re.M))
    assert out["Choice"] in ("Positive", "Negative")
    assert re.fullmatch(r"\w+(@\w*(\.(c(om?)?)?)?)?", out["Regex"]), out["Regex"]
    assert out["JSON"].startswith("{") and out["Grammar"].startswith("SELECT col_")
    assert examples.built == [("Qwen/Qwen2.5-3B-Instruct", {"max_model_len": 100})]
