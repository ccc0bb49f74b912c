"""The command line as a user meets it: each mistake -> exit 2, one clear line, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from fd_core.exit_codes import ExitCode
from fd_core.testing.tiny_model import make_tiny_llama
from tests.conftest import run_fd_serve

#: (arguments, a part of the one error line). Each runs in a fresh interpreter, as a user would.
MISTAKES = [
    (["--chek"], "unknown flag --chek; did you mean --check?"),
    (["--model", "/x"], "unknown flag --model; did you mean --model.source?"),
    (["--port", "9000"], "unknown flag --port; did you mean --server.port?"),
    (["--check", "--block-size", "8"], "unknown flag --block-size; did you mean --cache.block_size?"),
    (["serve"], "unexpected argument 'serve'"),
    (["--log-level", "bogus"], "argument --log-level: invalid choice: 'BOGUS'"),
    (["--check", "--cache.block_size"], "flag --cache.block_size needs a value"),
    (["--check", "--cache.block_size", "zero"], "cache.block_size: Input should be a valid integer"),
    (["--config", "/no/such/deploy.toml"], "--config: file not found"),
    # section 4: what used to pass --check and fail later
    (["--model.source", "/nonexistent"], "model.source: model '/nonexistent' not found"),
    (["--check", "--model.source", "smollm2-135m"], "did you mean 'smollm2-135m-instruct'?"),
    (["--check", "--model.dtype", "float16"], "model.dtype: 'float16' is not supported by platform 'cpu'"),
    (["--check", "--parallel.tensor_parallel_size", "4"],
     "parallel.tensor_parallel_size: 4 is not supported yet: only 1 runs"),
    (["--check", "--connector.name", "nccl"], "connector.name: plugin fd.connectors/nccl: no such connector"),
    (["--check", "--connector.options", '{"port": 1}'], "connector.options: given, but connector.name is 'none'"),
    (["--check", "--server.api_key", ""], "server.api_key: must not be empty or blank"),
    (["--check", "--server.api_key", "   "], "server.api_key: must not be empty or blank"),
]


def _error_lines(stderr: str) -> list[str]:
    # A concurrently installed broken test plugin may add its own WARNING line; that is not ours.
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING ")]


@pytest.mark.parametrize(("args", "expected"), MISTAKES, ids=[" ".join(a) or "-" for a, _ in MISTAKES])
def test_a_user_mistake_is_one_line_and_exit_2(args, expected):
    result = run_fd_serve(*args, timeout=60)
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "Future exception" not in output
    assert result.returncode == 2, output
    lines = _error_lines(result.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith("fd-serve: error: ") and expected in lines[0], lines[0]
    assert "serving" not in result.stdout  # the server never started


def test_a_busy_port_is_refused_before_the_engine_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_fd_serve("--server.port", str(port), "--model.source", str(make_tiny_llama(tmp_path / "m")),
                              timeout=60)
    assert result.returncode == ExitCode.CANNOT_LISTEN == 4, result.stdout + result.stderr
    [line] = _error_lines(result.stderr)
    assert line.startswith(f"fd-serve: error: cannot listen on 127.0.0.1:{port} (server.host, server.port): ")
    assert "Traceback" not in result.stderr and "engine start-up" not in result.stderr


def test_every_config_problem_is_reported_at_once():
    result = run_fd_serve("--check", "--model.source", "/nonexistent", "--model.dtype", "float16",
                          "--parallel.tensor_parallel_size", "4", "--engine.max_num_seqs", "8")
    assert result.returncode == 2
    lines = _error_lines(result.stderr)
    assert [line.split(": ")[2] for line in lines] == [
        "model.source", "parallel.tensor_parallel_size", "model.dtype"]
    assert "more)" not in result.stderr
    result = run_fd_serve("--check", "--cache.block_size", "0", "--server.port", "-1", "--model.seed", "x")
    keys = [line.split(": ")[2] for line in _error_lines(result.stderr)]
    assert result.returncode == 2 and keys == ["model.seed", "cache.block_size", "server.port"]


def test_an_env_value_names_its_variable_and_the_cli_beats_it():
    result = run_fd_serve("--check", env={"FD_CACHE__BLOCK_SIZE": "0", "FD_MODEL__SOURCE": "/nope"})
    assert result.returncode == 2
    assert "cache.block_size: Input should be greater than 0 (from FD_CACHE__BLOCK_SIZE)" in result.stderr
    result = run_fd_serve("--check", env={"FD_MODEL__SOURCE": "/nope"})
    assert "(from FD_MODEL__SOURCE)" in result.stderr and "model.source: model '/nope' not found" in result.stderr
    result = run_fd_serve("--check", "--model.source", "/also-nope", env={"FD_MODEL__SOURCE": "/nope"})
    assert "'/also-nope' not found" in result.stderr and "FD_MODEL__SOURCE" not in result.stderr


def test_check_resolves_the_prefix_caching_default_and_prints_no_paddle_warning():
    result = run_fd_serve("--check")
    assert result.returncode == 0, result.stderr
    assert '"enable_prefix_caching": true' in result.stdout  # v1 has a prefix cache
    assert "ccache" not in result.stderr


def test_version_and_help():
    from fd_core.cli_usage import help_text

    version = run_fd_serve("--version")
    assert version.returncode == 0 and version.stdout.startswith("fd-serve (fd-engine) 0.")
    shown = run_fd_serve("--help").stdout
    assert shown == help_text() + "\n"
    assert shown.startswith("usage: fd-serve ")
    assert "``" not in shown and ":class:" not in shown  # no raw reStructuredText
    assert "--cache.block_size INT" in shown and "(default: 64)" in shown
    assert "--model.dtype {float32,bfloat16,float16}" in shown and "(default: INFO)" in shown


def _run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    return subprocess.run([sys.executable, "-m", "fd_core.bench.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_fd_bench_without_a_subcommand_exits_2_with_usage():
    result = _run_bench()
    assert result.returncode == 2
    assert result.stderr.startswith("fd-bench: error: a subcommand is required\nusage: fd-bench {serve,throughput}")
    wrong = _run_bench("serv")
    assert wrong.returncode == 2 and "did you mean 'serve'?" in wrong.stderr
    assert _run_bench("--help").returncode == 0


def test_fd_bench_serve_against_a_server_that_is_down():
    import socket

    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = _run_bench("serve", "--url", url, "--num-prompts", "1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"fd-bench serve: error: cannot read {url}/v1/models: ") and "is fd-serve running" in line


def test_plugins_check_help_names_every_seam():
    from fd_core.cli_usage import plugins_check_help_text
    from fd_core.seams import SEAMS

    text = plugins_check_help_text()
    listed = text[text.index("Seams: "):].split(".")[0].removeprefix("Seams: ").replace("\n", " ")
    assert [name.strip() for name in listed.split(",")] == [seam.name for seam in SEAMS]
