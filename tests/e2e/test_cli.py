"""The README's run command, as written (minus the setup step, and on free ports): a real model
answers in English through the disaggregated path, on a quiet console, and exits cleanly."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import DEMO_MAX_TOKENS
from tests.conftest import PackagedModelFiles
from tests.test_repo import ROOT, _readme_commands
from tests.utils import EAGER_FLAG, chat_prompts, hf_greedy_ids

pytestmark = pytest.mark.slow

# What must never reach a log file either: our own deprecated calls into vLLM, and engines killed
# at exit (which is what leaks their shared memory).
# The last: vLLM's AOT compile cache failing to load on CPU (splitserve/compilation.py).
_NEVER_IN_LOGS = ("Passing raw prompts", "leaked shared_memory", "force killing",
                  "Compiling model again due to a load failure")


def _reference_answer(model_dir: Path, question: str) -> str:
    """transformers' greedy answer on the same weights, in float32 (the dtype `up` picks for a
    checkpoint stored in float32)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    (ids,) = hf_greedy_ids(model, chat_prompts(model_dir, [question]), DEMO_MAX_TOKENS)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids)


# The README's demo compiles SmolLM2 on a host's first start (about 90 s of it on 2 cores).
@pytest.mark.budget(150)
def test_readme_run_command_answers_the_greedy_reference_quietly(
        smollm2: PackagedModelFiles) -> None:
    run = _readme_commands()[0].split("&&", 1)[1].strip()
    argv = shlex.split(run)
    assert argv[:3] == [".venv/bin/splitserve", "up", "--demo"] and len(argv) == 4
    out = subprocess.run([sys.executable, "-m", "deploy.cli", *argv[1:], "--grpc-port", "0",
                          "--http-port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    logs = re.search(r"^\[splitserve\] logs: (\S+)/ ", out.stderr, flags=re.M)
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        answer = _reference_answer(smollm2.model_dir, argv[3])
        assert "Paris" in answer  # the reference itself is an answer, not noise
        assert out.stdout == answer + "\n"  # stdout: the answer, and only it
        # The console is ours alone: progress lines and the client's summary, no warnings.
        lines = out.stderr.splitlines()
        assert all(ln.startswith("[") for ln in lines), out.stderr
        assert not re.search("warn|deprecat|error", out.stdout + out.stderr, flags=re.I)
        assert any(re.match(r"\[splitserve\] (prefill|decode)-\d ready in \d+ s", ln)
                   for ln in lines), out.stderr
        assert "[splitserve] ready in" in out.stderr and "OpenAI API: http" in out.stderr
        # Compiled by default, as plain vLLM runs; the console says so while it compiles.
        for name in ("prefill-0", "decode-1"):
            assert f"[splitserve] {name}: compiling the model" in out.stderr, out.stderr
        # The first token came from the prefill worker, the rest after a KV hand-off.
        assert "; disaggregated: prefill" in out.stderr, out.stderr
        assert logs is not None, out.stderr
        for log in Path(logs.group(1)).glob("*.log"):
            text = log.read_text(errors="replace")
            for bad in _NEVER_IN_LOGS:
                assert bad not in text, f"{log.name}: {bad!r}"
            if log.name != "router.log":
                assert "compiled: torch.compile (Inductor)" in text, log.name
        assert {p.name for p in Path(logs.group(1)).glob("*.log")} == {
            "router.log", "prefill-0.log", "decode-1.log"}
    finally:
        if logs is not None:
            shutil.rmtree(logs.group(1), ignore_errors=True)


@pytest.fixture(scope="module")
def default_cluster(smollm2: PackagedModelFiles, tmp_path_factory: pytest.TempPathFactory):
    """`splitserve up` as README's "Using it" starts it (default model), its servers on ports
    they bind themselves; yields (gRPC address, HTTP base URL)."""
    import json
    import signal

    tmp = tmp_path_factory.mktemp("up")
    err, ready = tmp / "stderr", tmp / "ready.json"
    with open(err, "w") as err_f:
        # Eager: the README demo above proves the compiled default; here start-up would dominate.
        p = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--grpc-port", "0",
                              "--http-port", "0", "--ready-file", str(ready), EAGER_FLAG],
                             cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=err_f, text=True)
    try:
        address = p.stdout.readline().strip()  # its one stdout line, once everything is ready
        assert address, err.read_text()[-3000:]
        router = json.loads(ready.read_text())["router"]
        assert router["grpc"] == address
        yield address, router["http"]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(120)
        except subprocess.TimeoutExpired:
            # Deaf to SIGINT: it goes anyway, and its workers with it (each watches its
            # parent: splitserve/lifeline.py).
            p.kill()
            p.wait()
            raise AssertionError("`up` ignored SIGINT for 120 s: "
                                 + err.read_text()[-3000:]) from None
        assert rc == 0, err.read_text()[-3000:]


def _readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_http_examples_answer_in_english(default_cluster, smollm2) -> None:
    """README's curl (completions) and OpenAI-client (chat) examples, as written but for the
    port, answer what transformers answers greedily on the same weights."""
    import json

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, base = default_cluster
    here = lambda code: code.replace("http://127.0.0.1:8000", base)  # noqa: E731
    (curl,) = [b for b in _readme_blocks("bash") if b.startswith("curl")]
    body = json.loads(subprocess.run(["bash", "-c", here(curl)], capture_output=True, text=True,
                                     timeout=120, check=True).stdout)
    request = json.loads(re.search(r"-d '(.*)'", curl, flags=re.S).group(1))
    (py,) = _readme_blocks("python")
    out = subprocess.run([sys.executable, "-c", here(py)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    chat = re.search(r'messages=\[\{"role": "user", "content": "(.*?)"\}\]', py)
    max_chat = int(re.search(r"max_tokens=(\d+)", py).group(1))
    assert request["temperature"] == 0 and "temperature=0" in py  # greedy: comparable

    model = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(smollm2.model_dir / "tokenizer.json"))
    prompt = AutoTokenizer.from_pretrained(smollm2.model_dir)(request["prompt"]).input_ids
    (text_ids,) = hf_greedy_ids(model, [prompt], request["max_tokens"])
    (chat_ids,) = hf_greedy_ids(model, chat_prompts(smollm2.model_dir, [chat.group(1)]),
                                max_chat)
    assert body["choices"][0]["text"] == tok.decode(text_ids)
    assert out.stdout == tok.decode(chat_ids) + "\n"
    assert re.search(r"[a-z]+ [a-z]+ [a-z]+", out.stdout)  # words, not token soup


def test_chat_keeps_the_conversation(default_cluster, smollm2) -> None:
    """`splitserve chat`: each turn streams, and the next one carries the history."""
    address, _ = default_cluster
    turns = "What is 2 + 2?\nAnd that times ten?\n/exit\n"
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "chat", "--router", address,
                          "--max-tokens", "32"], input=turns, capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    usage = [tuple(map(int, m)) for m in re.findall(
        r"(\d+) prompt \+ (\d+) completion tokens", out.stderr)]
    assert len(usage) == 2, out.stderr
    (p1, c1), (p2, _) = usage
    assert p2 > p1 + c1  # the first question and its answer went along with the second
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()
    (ids,) = hf_greedy_ids(model, chat_prompts(smollm2.model_dir, ["What is 2 + 2?"]), 32)
    tok = Tokenizer.from_file(str(smollm2.model_dir / "tokenizer.json"))
    assert out.stdout.startswith(tok.decode(ids) + "\n")
