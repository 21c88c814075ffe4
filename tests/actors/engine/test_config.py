"""``EngineConfig``: one definition of every option, its flag, variable, unit and bounds."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

import pytest

from actors.cli import build_parser, main
from actors.cli.serve import serve_config
from actors.engine import ConfigError, Engine, EngineConfig, EngineOptions
from actors.engine.config import GIB, SETTINGS, option_names
from actors.http import Defaults, HttpSettings
from kernels._memory import MAX_DEFAULT_PROMPT_CACHE_BYTES
from messages.gateway import GenerationParams

FLOAT_FIELDS = [
    name
    for name, info in EngineConfig.model_fields.items()
    if float in typing.get_args(info.annotation) or info.annotation is float
    or SETTINGS[name].scale != 1
]


def _serve_args(*argv: str, device: typing.Any = None) -> EngineConfig:
    full = ["serve", *argv]
    return serve_config(build_parser(full).parse_args(full), device=device)


def test_engine_options_are_exactly_the_engine_fields() -> None:
    """EngineOptions (the typed Engine kwargs) lists every engine, sampling and SSD field, max_burst included."""
    assert "max_burst" in EngineOptions.__annotations__
    expected = set(option_names("engine", "sampling", "ssd")) - {"model"}
    assert set(EngineOptions.__annotations__) == expected


# NOTE: the only places where an Engine keyword accepts more than the field it
# sets: EngineConfig's validators coerce these inputs (a kv_quant bit count
# given as an int, an ssd_cache directory given as a str).
_WIDENED_OPTIONS: dict[str, object] = {
    "kv_quant": str | int | None,
    "ssd_cache": str | Path | None,
}


def _accepts(option: object, value: object) -> bool:
    """Whether a value of the config field's type is allowed by the (wider) option type."""
    allowed = typing.get_args(option) or (option,)
    return any(value is a or (isinstance(a, type) and isinstance(value, a)) for a in allowed)


def test_engine_options_have_the_engine_field_types_in_field_order() -> None:
    """Each EngineOptions key has its EngineConfig field's type (or a listed coerced widening of it), in field order."""
    options = typing.get_type_hints(EngineOptions)
    fields = typing.get_type_hints(EngineConfig)
    assert list(options) == [name for name in fields if name in options]
    for name, hint in options.items():
        if name not in _WIDENED_OPTIONS:
            assert hint == fields[name], name
            continue
        assert hint == _WIDENED_OPTIONS[name], name
        field = fields[name]
        union = typing.get_origin(field) in (typing.Union, types.UnionType)
        members = typing.get_args(field) if union else (field,)
        for member in members:
            # A Literal member contributes its values; a class contributes itself.
            values = typing.get_args(member) if typing.get_origin(member) is typing.Literal else ()
            if values:
                assert all(_accepts(hint, v) for v in values), (name, member)
            else:
                assert member in typing.get_args(hint), (name, member)


def test_max_tokens_default_is_one_number_everywhere() -> None:
    """The embedded default, the HTTP default and GenerationParams' default are the same max_tokens."""
    assert GenerationParams().max_tokens == EngineConfig().max_tokens == Defaults().max_tokens
    assert EngineConfig().default_params() == GenerationParams()
    assert HttpSettings().defaults == Defaults.from_config(EngineConfig())


def test_prompt_cache_gb_is_gib_like_the_default_clamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """--prompt-cache 8 and KVTIER_PROMPT_CACHE_GB=8 both mean the default clamp's 8 GiB exactly."""
    assert _serve_args("--prompt-cache", "8").prompt_cache_bytes == MAX_DEFAULT_PROMPT_CACHE_BYTES
    env = EngineConfig.from_env({"KVTIER_PROMPT_CACHE_GB": "8"})
    assert env.prompt_cache_bytes == 8 * GIB == MAX_DEFAULT_PROMPT_CACHE_BYTES
    monkeypatch.setenv("KVTIER_PROMPT_CACHE_GB", "0.5")
    assert _serve_args().prompt_cache_bytes == GIB // 2


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_float_flags_exit_2(
    name: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every float option refuses nan and ±inf on the command line: exit 2 naming the flag."""
    flag = SETTINGS[name].flag
    assert main(["serve", "--model", "/nonexistent", f"{flag}={bad}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier serve:")
    assert flag in err


def test_non_finite_env_and_kwargs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """nan/inf from a variable or an Engine keyword is a ConfigError naming the option."""
    with pytest.raises(ConfigError, match="KVTIER_TEMPERATURE"):
        EngineConfig.from_env({"KVTIER_TEMPERATURE": "nan"})
    with pytest.raises(ConfigError, match="ask_timeout_s"):
        Engine(ask_timeout_s=math.inf)
    with pytest.raises(ConfigError, match="KVTIER_PROMPT_CACHE_GB"):
        EngineConfig.from_env({"KVTIER_PROMPT_CACHE_GB": "inf"})


def test_unknown_engine_option_is_a_clear_error() -> None:
    """A misspelt Engine keyword is refused with its name and the closest real option."""
    with pytest.raises(ConfigError, match=r"unknown option 'max_qeue'; did you mean 'max_queue'\?"):
        Engine(max_qeue=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"'port'.*kvtier serve"):
        Engine(port=9)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        Engine.from_loaded(None, None, model_id="m", drain_timeout_s=1.0)  # type: ignore[call-arg]


def test_bounds_are_enforced_with_the_flag_named() -> None:
    """Out-of-range values are refused naming the field, its flag and its variable."""
    with pytest.raises(ConfigError, match=r"max_burst \(--max-burst, KVTIER_MAX_BURST\)"):
        EngineConfig(max_burst=1).replace(max_burst=0)
    with pytest.raises(ConfigError, match="must not exceed"):
        EngineConfig.build({"max_tokens": 10, "max_tokens_limit": 5})
    with pytest.raises(ValueError, match="max_queue"):
        Engine(max_queue=-1)


def test_sources_precedence_defaults_env_explicit() -> None:
    """Explicit values beat KVTIER_* variables, which beat defaults; EngineConfig() reads no variables."""
    env = {"KVTIER_MAX_QUEUE": "3", "KVTIER_MAX_BURST": "5"}
    cfg = EngineConfig.from_env(env, max_queue=7)
    assert (cfg.max_queue, cfg.max_burst, cfg.prefill_step_size) == (7, 5, 512)
    assert Engine(config=cfg, max_burst=2).config.max_burst == 2


def test_serve_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag beats its variable, the variable beats the default; bools take on/off."""
    monkeypatch.setenv("KVTIER_MAX_QUEUE", "3")
    monkeypatch.setenv("KVTIER_SSD_WRITEBEHIND", "0")
    cfg = _serve_args("--max-burst", "2", "--ssd-cache-verify", "off")
    assert (cfg.max_queue, cfg.max_burst, cfg.ssd_cache_verify, cfg.ssd_writebehind) == (
        3, 2, False, False,
    )
    assert _serve_args("--max-queue", "9").max_queue == 9


def test_help_shows_every_flag_default_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    """kvtier serve --help lists each EngineConfig field's flag, a default and its KVTIER_ variable."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for setting in SETTINGS.values():
        assert setting.flag in out
        assert f"env {setting.env})" in out
    assert "(default: 512 tokens; env KVTIER_MAX_TOKENS)" in out


def test_ssd_tier_defaults_and_its_ram_tier_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve puts the SSD tier at $KVTIER_HOME/kv (the Engine keeps it off); --prompt-cache 0 with it named is refused."""
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    monkeypatch.delenv("KVTIER_SSD_CACHE", raising=False)
    assert _serve_args().ssd_cache == tmp_path / "kv"
    assert _serve_args("--ssd-cache", "off").ssd_cache is None
    assert _serve_args("--prompt-cache", "0").ssd_cache is None
    assert EngineConfig.from_env({}).ssd_cache is None
    spill = EngineConfig().ssd_spill_queue_bytes
    assert spill == 2 * GIB == _serve_args().ssd_spill_queue_bytes
    assert (EngineConfig().ssd_demote_idle, EngineConfig().shutdown_timeout) == (300.0, 120.0)
    with pytest.raises(ConfigError, match="needs the RAM prompt cache"):
        _serve_args("--prompt-cache", "0", "--ssd-cache", str(tmp_path / "x"))
    with pytest.raises(ConfigError, match="needs the RAM prompt cache"):
        EngineConfig(prompt_cache_bytes=0, ssd_cache=tmp_path)


def test_kv_quant_accepts_the_engine_spellings() -> None:
    """kv_quant takes 4 / 8 as ints and None as off (the Engine API's old spellings)."""
    assert EngineConfig.build({"kv_quant": 4}).kv_quant == "4"
    assert EngineConfig.build({"kv_quant": None}).kv_quant == "off"
    with pytest.raises(ConfigError, match="kv_quant"):
        EngineConfig.build({"kv_quant": 3})


def test_api_key_is_not_echoed() -> None:
    """The API key stays out of the config's repr."""
    assert "s3cret" not in repr(EngineConfig(api_key="s3cret"))


def test_docs_table_lists_every_option() -> None:
    """docs/engine.md's configuration table has a row for every field with its flag and variable."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "engine.md").read_text()
    for name, setting in SETTINGS.items():
        assert f"| `{name}` | `{setting.flag}` | `{setting.env}` |" in text


def test_serve_runs_the_batch_lane_by_default_and_the_engine_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kvtier serve` defaults to the device's SERVE_MAX_BATCH rows; --max-batch and KVTIER_MAX_BATCH override it; Engine keeps 1."""
    from actors.cli.serve import SERVE_MAX_BATCH, device_kind

    monkeypatch.delenv("KVTIER_MAX_BATCH", raising=False)
    assert _serve_args().max_batch == SERVE_MAX_BATCH[device_kind()] > 1
    assert _serve_args("--max-batch", "1").max_batch == 1
    assert EngineConfig().max_batch == 1
    monkeypatch.setenv("KVTIER_MAX_BATCH", "3")
    assert _serve_args().max_batch == 3


@pytest.mark.parametrize(("device", "tokens"), [("cpu", 256), ("cuda", 2048), ("metal", 2048)])
def test_serve_prefill_chunk_default_follows_the_device(
    monkeypatch: pytest.MonkeyPatch, device: str, tokens: int
) -> None:
    """With neither --prefill-step-size nor its variable, serve's chunk comes from the device (CPU 256, CUDA and Metal 2048); a flag or variable wins; Engine keeps 512."""
    monkeypatch.delenv("KVTIER_PREFILL_STEP_SIZE", raising=False)
    assert _serve_args(device=device).prefill_step_size == tokens
    assert _serve_args("--prefill-step-size", "64", device=device).prefill_step_size == 64
    assert EngineConfig().prefill_step_size == 512
    monkeypatch.setenv("KVTIER_PREFILL_STEP_SIZE", "96")
    assert _serve_args(device=device).prefill_step_size == 96


@pytest.mark.parametrize(("device", "rows"), [("cpu", 8), ("cuda", 32), ("metal", 8)])
def test_serve_max_batch_default_follows_the_device(
    monkeypatch: pytest.MonkeyPatch, device: str, rows: int
) -> None:
    """With neither --max-batch nor KVTIER_MAX_BATCH, serve's rows come from the device (CPU 8, CUDA 32, Metal 8); a flag, a variable or tensor parallelism win."""
    monkeypatch.delenv("KVTIER_MAX_BATCH", raising=False)
    monkeypatch.delenv("KVTIER_TENSOR_PARALLEL", raising=False)
    assert _serve_args(device=device).max_batch == rows
    assert _serve_args("--max-batch", "5", device=device).max_batch == 5
    assert _serve_args("--tensor-parallel", "on", device=device).max_batch == 1
    monkeypatch.setenv("KVTIER_MAX_BATCH", "3")
    assert _serve_args(device=device).max_batch == 3


def test_device_cpu_gives_serve_the_cpu_defaults_beside_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cpu (or KVTIER_DEVICE=cpu) makes serve take the CPU's rows and prefill chunk where a GPU is found; auto keeps the GPU's."""
    import actors.cli.serve as serve

    for name in ("KVTIER_MAX_BATCH", "KVTIER_PREFILL_STEP_SIZE", "KVTIER_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(serve, "device_kind", lambda: "cuda")
    auto = _serve_args()
    assert (auto.device, auto.max_batch, auto.prefill_step_size) == ("auto", 32, 2048)
    cpu = _serve_args("--device", "cpu")
    assert (cpu.device, cpu.max_batch, cpu.prefill_step_size) == ("cpu", 8, 256)
    monkeypatch.setenv("KVTIER_DEVICE", "cpu")
    assert _serve_args().max_batch == 8
    with pytest.raises(SystemExit):
        _serve_args("--device", "tpu")
