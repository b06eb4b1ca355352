"""``kiln build | run | inspect`` through ``kiln.cli.main`` in-process, plus the installed
console script in a subprocess. Bad input exits 2 with one line naming the field and what
is allowed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from kiln.build.loader import load_engine
from kiln.cli import main

from .util import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hf"))


def one_error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one error line on stderr, its last (progress lines of a build may precede it)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if "error" in ln]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert lines[-1].startswith(f"kiln {command}: error: "), err
    return lines[-1]


# ---- build -----------------------------------------------------------------------------


def test_build_prints_wall_time_and_engine_loads(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    assert main(["build", "--model", str(tiny_hf), "--output", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert re.search(rf"built {re.escape(str(out))} in \d+\.\d s", stdout), stdout
    assert "LlamaForCausalLM" in stdout and "MiB on disk" in stdout
    engine = load_engine(out)
    assert engine.config.vocab_size == 300
    assert engine.manifest["source"]["model"] == str(tiny_hf.resolve())


def test_build_defaults_to_the_embedded_model(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Like ``kiln run``, ``kiln build`` without ``--model`` builds the embedded model (its
    path stood in for by the tiny checkpoint here) and says so."""
    out = tmp_path / "engine"
    with mock.patch("kiln.checkpoint.default_model_path", return_value=tiny_hf):
        assert main(["build", "--output", str(out)]) == 0
    assert "model: embedded SmolLM2" in capsys.readouterr().err
    assert load_engine(out).manifest["source"]["model"] == str(tiny_hf.resolve())


def test_build_options_reach_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    argv = ["build", "--model", "dummy:tiny", "--output", str(out), "--max-batch-size", "3"]
    assert main([*argv, "--max-seq-len", "128", "--dtype", "bfloat16", "--seed", "5"]) == 0
    m = load_engine(out).manifest
    assert m["limits"]["max_batch_size"] == 3
    assert m["limits"]["max_seq_len"] == 128
    assert m["dtype"] == "bfloat16"
    assert m["weights"] == {"kind": "dummy", "seed": 5}
    assert main(["inspect", str(out)]) == 0
    assert "max_batch_size 3, max_seq_len 128" in capsys.readouterr().out


def test_build_calib_tokens_reach_the_manifest(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 4)
    argv = ["build", "--model", str(tiny_hf), "--output", str(out), "--quant", "int4-awq"]
    argv += ["--kv-cache-dtype", "fp8", "--calib-text", str(calib)]
    argv += ["--group-size", "16", "--calib-tokens", "96", "--quality-tokens", "32"]
    from kiln.build import builder
    from kiln.quant import calibration

    spy_ids = mock.patch.object(
        builder, "calibration_token_ids", wraps=builder.calibration_token_ids
    )
    spy_read = mock.patch.object(calibration, "load_text", wraps=calibration.load_text)
    with spy_ids as ids, spy_read as read:
        assert main(argv) == 0
    # the file read once (checked before conversion) and tokenized once, for the weights'
    # 96 tokens; the KV cache calibrates on a prefix of the same ids
    assert read.call_count == 1 and ids.call_count == 1, (read.call_args_list, ids.call_args_list)
    assert ids.call_args.args[2] == 96 and ids.call_args.kwargs["text"] == calib.read_text()
    quant = load_engine(out).manifest["quant"]
    assert quant["calib_tokens"] == 96 and len(quant["kv_scales"]) > 0
    assert main([*argv[:-4], "--calib-tokens", "0", "--output", str(tmp_path / "e2")]) == 2
    line = one_error_line(capsys, "build")
    assert "quant.calib_tokens=0 is invalid" in line and "16" in line, line


def test_build_auto_exclude_flag(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--auto-exclude reaches the build (a generous limit: nothing kept) and is refused,
    naming the field, without --max-quality-loss."""
    out = tmp_path / "engine"
    argv = ["build", "--model", str(tiny_hf), "--output", str(out), "--quant", "fp8"]
    argv += ["--quality-tokens", "32", "--auto-exclude", "3"]
    assert main([*argv, "--max-quality-loss", "1000"]) == 0
    q = load_engine(out).manifest["quant"]
    assert q["auto_exclude"] == 3 and "auto_excluded" not in q
    assert main([*argv[:4], str(tmp_path / "e2"), *argv[5:]]) == 2
    line = one_error_line(capsys, "build")
    assert "quant.auto_exclude=3 is invalid" in line and "--max-quality-loss" in line, line


def test_build_with_tensor_parallelism_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    assert main(["build", "--model", "dummy:tiny", "--output", str(out), "--tp", "2"]) == 2
    line = one_error_line(capsys, "build")
    assert "--tp 2" in line and "not available in this version" in line and "--tp 1" in line
    assert not out.exists()


def test_build_into_a_non_engine_directory_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["build", "--model", "dummy:tiny", "--output", str(tmp_path)]) == 2
    assert "not an engine" in one_error_line(capsys, "build")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_build_missing_model_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "engine"
    assert main(["build", "--model", "/does/not/exist", "--output", str(out)]) == 2
    line = one_error_line(capsys, "build")
    assert "'/does/not/exist' does not exist" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        # tiny's projections take 64 (qkv, o, gate_up) and 176 (down) inputs
        (["--quant", "int4-awq"], ["quant.group_size=128", "(64, 176 in this model)",
                                   "--group-size 16 fits"]),
        (["--quant", "int4-awq", "--group-size", "32"], ["quant.group_size=32"]),
        (["--quant", "fp8", "--exclude-modules", "layers.0.attn.qkv,*.atn.o"],
         ["quant.exclude_modules='*.atn.o'", "layers.0.attn.o"]),
        (["--quant", "fp8", "--exclude-modules", "lm_head"], ["lm_head.proj with"]),
        (["--quant", "fp8", "--activation-scheme", "outliers", "--outlier-modules", "down"],
         ["quant.outlier_modules='down'"]),
        (["--quant", "fp8", "--sq-alpha", "0.3"], ["quant.sq_alpha=0.3", "w8a8-sq"]),
        (["--sq-alpha", "0.5"], ["quant.sq_alpha=0.5"]),
        (["--quant", "fp8", "--calib-text", "my.txt"], ["quant.calib_text='my.txt'",
                                                        "None for dummy: models"]),
    ],
)  # fmt: skip
def test_build_refuses_options_the_model_cannot_take_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expect: list[str]
) -> None:
    """Checked against the model's projections (a meta model) before the output directory
    is made; with the group size, the error names the sizes and a group that fits."""
    out = tmp_path / "engine"
    with mock.patch("kiln.build.builder._convert_weights") as convert:
        assert main(["build", "--model", "dummy:tiny", "--output", str(out), *extra]) == 2
    line = one_error_line(capsys, "build")
    assert all(e in line for e in expect), line
    assert convert.call_count == 0 and not out.exists()
    assert not list(tmp_path.iterdir())  # not even a temporary build directory


def test_build_api_refuses_an_unused_sq_alpha(tmp_path: Path) -> None:
    """Through the Python API too, any given value, the default's 0.5 included (None
    stands for "not given"); the modes that migrate default to 0.5; an older engine's
    manifest that records an unused alpha still loads."""
    from kiln.build.builder import build_engine
    from kiln.config import DEFAULT_SQ_ALPHA, BuildConfig, QuantConfig
    from kiln.errors import ConfigError

    for alpha in (0.3, DEFAULT_SQ_ALPHA):
        cfg = BuildConfig(device="cpu", quant=QuantConfig(algo="fp8", sq_alpha=alpha))
        with pytest.raises(ConfigError, match=rf"quant\.sq_alpha={alpha} is invalid: only w8a8"):
            build_engine("dummy:tiny", tmp_path / "e", cfg, progress=False)
        assert not (tmp_path / "e").exists()
    assert QuantConfig(algo="fp8").sq_alpha is None and QuantConfig().sq_alpha is None
    assert QuantConfig(algo="w8a8-sq").sq_alpha == DEFAULT_SQ_ALPHA
    assert QuantConfig(algo="fp8", activation_scheme="smooth").sq_alpha == DEFAULT_SQ_ALPHA
    assert QuantConfig.from_dict({"algo": "fp8", "sq_alpha": 0.5}).sq_alpha == 0.5


def test_build_calib_text_checked_before_converting(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    argv = ["build", "--model", str(tiny_hf), "--output", str(out)]
    with mock.patch("kiln.build.builder._convert_weights") as convert:
        assert main([*argv, "--quant", "fp8", "--calib-text", str(tmp_path / "no.txt")]) == 2
        line = one_error_line(capsys, "build")
        assert "quant.calib_text=" in line and "a UTF-8 text file that exists" in line, line
        assert "does not exist" in line, line
        assert main([*argv, "--calib-text", str(tmp_path / "no.txt")]) == 2
        line = one_error_line(capsys, "build")
        assert "None unless --quant or --kv-cache-dtype fp8 calibrates" in line, line
    assert convert.call_count == 0 and not out.exists()


@pytest.mark.parametrize(
    ("body", "said"),
    [(b"\xff\xfe\x00bad", "is not UTF-8"), (b" \n\t\n", "is blank")],
)
def test_build_calib_text_not_utf8_or_blank_refused_before_converting(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], body: bytes, said: str
) -> None:
    (tmp_path / "calib.txt").write_bytes(body)
    out = tmp_path / "engine"
    argv = ["build", "--model", str(tiny_hf), "--output", str(out), "--quant", "fp8"]
    with mock.patch("kiln.build.builder._convert_weights") as convert:
        assert main([*argv, "--calib-text", str(tmp_path / "calib.txt")]) == 2
    line = one_error_line(capsys, "build")
    assert "quant.calib_text=" in line and "with text in it" in line, line
    assert said in line, line
    assert convert.call_count == 0 and not out.exists()


# ---- run -------------------------------------------------------------------------------


def test_run_dummy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "dummy:tiny", "--max-tokens", "5", "--raw", "hello"]) == 0
    err = capsys.readouterr().err
    assert "loaded in" in err
    assert "error" not in err


def test_run_built_engine_directory(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine"
    assert main(["build", "--model", str(tiny_hf), "--output", str(out)]) == 0
    assert main(["run", "--model", str(out), "--max-tokens", "3", "--raw", "hi"]) == 0
    assert "loaded in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "field", "allowed"),
    [
        (["--temperature", "-1"], "temperature=-1.0", ">= 0"),
        (["--temperature", "nan"], "temperature=nan", "finite"),
        (["--top-p", "0"], "top_p=0.0", "(0, 1]"),
        (["--top-p", "1.5"], "top_p=1.5", "(0, 1]"),
        (["--top-k", "-2"], "top_k=-2", "-1 or 0 (disabled) or an integer >= 1"),
        (["--max-tokens", "0"], "max_tokens=0", ">= 1"),
        (["--max-batch-size", "0"], "max_batch_size=0", "positive integer"),
        (["--max-num-tokens", "0"], "max_num_tokens=0", "positive integer"),
        (["--max-seq-len", "1"], "max_seq_len=1", ">= 2"),
        (["--max-seq-len", "4096"], "max_seq_len=4096", "at most 2048"),
    ],
)
def test_run_bad_value(
    capsys: pytest.CaptureFixture[str], args: list[str], field: str, allowed: str
) -> None:
    argv = ["run", "--model", "dummy:tiny", "--max-tokens", "4", "--raw", *args, "hi"]
    assert main(argv) == 2
    line = one_error_line(capsys, "run")
    assert field in line, line
    assert allowed in line, line


def test_run_missing_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "/does/not/exist", "--raw", "hi"]) == 2
    line = one_error_line(capsys, "run")
    assert "'/does/not/exist' does not exist" in line
    for source in ("config.json", ".gguf", "kiln build", "dummy:"):
        assert source in line


def test_run_unknown_dummy_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "dummy:nope", "--raw", "hi"]) == 2
    line = one_error_line(capsys, "run")
    assert "'nope'" in line and "tiny" in line


@pytest.mark.parametrize(
    ("argv", "bad"),
    [
        (["run", "--model", "dummy:tiny", "--dtype", "float8", "hi"], "float8"),
        (["run", "--model", "dummy:tiny", "--device", "tpu", "hi"], "tpu"),
        (["run", "--model", "dummy:tiny", "--max-tokens", "many", "hi"], "many"),
        (["build", "--model", "dummy:tiny", "--output", "x", "--dtype", "int4"], "int4"),
    ],
)
def test_argparse_rejects(capsys: pytest.CaptureFixture[str], argv: list[str], bad: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid" in err and bad in err


def test_run_chat_on_dummy(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --raw the prompt goes through a chat template (the byte-level fallback's)."""
    assert main(["run", "--model", "dummy:tiny", "--max-tokens", "2", "hi"]) == 0
    assert "loaded in" in capsys.readouterr().err


# ---- the installed console script ------------------------------------------------------


def kiln_script() -> Path:
    script = Path(sys.executable).parent / "kiln"
    assert script.is_file(), f"console script not installed next to {sys.executable}"
    return script


def test_console_script_runs_dummy() -> None:
    env = {**os.environ, "KILN_CACHE_DIR": os.environ["KILN_CACHE_DIR"]}
    proc = subprocess.run(
        [str(kiln_script()), "run", "--model", "dummy:tiny", "--max-tokens", "4", "--raw", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr


def test_python_dash_m_kiln_is_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "build", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: kiln build"), proc.stdout
    assert "embedded SmolLM2" in proc.stdout


@pytest.mark.slow
def test_console_script_embedded_model_knows_paris() -> None:
    env = {**os.environ, "KILN_CACHE_DIR": os.environ["KILN_CACHE_DIR"]}
    proc = subprocess.run(
        [str(kiln_script()), "run", "--max-tokens", "32", "What is the capital of France?"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "embedded SmolLM2" in proc.stderr
    assert "Paris" in proc.stdout, proc.stdout
