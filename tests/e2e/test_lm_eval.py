"""End to end: lm-evaluation-harness's ``local-completions`` scores a local multiple-choice task against ``kvtier serve``.

The harness sends ``echo: true, logprobs: 1, max_tokens: 1`` per choice and
reads ``token_logprobs[ctxlen:-1]``; every log-likelihood it reports must
equal mlx-lm's in-process log-softmax of the same tokens (one forward of the
whole sequence) within 1e-3. The accuracy is printed beside
``mlx_lm.evaluate``'s (its ``MLXLM`` model in-process) on the same task;
docs/benchmarks/eval.md records both. Needs the ``eval`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

_REPO = Path(__file__).resolve().parents[2]
_TASKS = _REPO / "tests" / "data" / "eval"
_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _lm_eval_bin() -> Path:
    return Path(sys.executable).with_name("lm_eval")


def _reference(model: Any, tok: Any, context: str, continuation: str) -> float:
    """mlx-lm in process: the continuation's summed log-softmax, tokenized as lm-eval does."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    ids = ctx + whole[len(ctx):]
    logits = model(mx.array(ids)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return float(sum(lp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids))))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_matches_mlx_lm(tmp_path: Path, default_model_path: Path,
                                                  batch_size: int) -> None:
    """lm-eval runs the task against kvtier serve (batch_size 4: lists of prompts); each log-likelihood equals mlx-lm's within 1e-3."""
    if not _lm_eval_bin().exists():
        pytest.skip("lm-eval is not installed (pip install -e '.[eval]')")
    from mlx_lm import load as mlx_load

    (tmp_path / "serve").mkdir()
    server = ServerProcess(tmp_path / "serve", "--max-tokens", "16")
    try:
        args = ",".join([
            f"base_url={server.url}/v1/completions", "model=default",
            f"tokenizer={default_model_path}", "tokenizer_backend=huggingface",
            "num_concurrent=1", "max_retries=1"])
        run = subprocess.run(
            [str(_lm_eval_bin()), "--model", "local-completions", "--model_args", args,
             "--tasks", "kvtier_mc", "--include_path", str(_TASKS), "--batch_size", str(batch_size),
             "--output_path", str(tmp_path / "out"), "--log_samples"],
            cwd=_REPO, env={**os.environ, **_OFFLINE}, capture_output=True, text=True,
            timeout=800, check=False)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        assert server.stop() == 0, server.logs()
    [samples_file] = (tmp_path / "out").rglob("samples_kvtier_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    acc = json.loads(results_file.read_text())["results"]["kvtier_mc"]["acc,none"]
    loaded = mlx_load(str(default_model_path))
    model, tok = loaded[0], loaded[1]
    checked = 0
    for sample in samples:
        for arg, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            served = float(resp[0][0])
            want = _reference(model, tok, arg["arg_0"], arg["arg_1"])
            assert served == pytest.approx(want, abs=1e-3), arg
            checked += 1
    assert checked == 4 * len(samples) == 80
    print(f"kvtier local-completions acc={acc:.3f}")
    assert acc >= 0.5, acc
