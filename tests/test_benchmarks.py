"""The benchmark commands run end to end: a bench whose module moved or whose import broke fails here, not when
someone next measures with it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.daemon import daemon_env


def test_bench_approvals_runs_a_round_and_prints_its_ratio() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "approvals", "--calls", "1", "--rounds", "1", "--turns", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert set(json.loads(done.stdout.splitlines()[-1])) >= {"bare_turn_ms_p50", "overseen_turn_ms_p50", "ratio"}


def test_bench_client_measures_every_side_against_the_bare_socket() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "client", "--calls", "20", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    ratios = json.loads(done.stdout)["ratio_to_bare_socket"]
    assert (sorted(ratios), ratios["bare socket"]) == (["AsyncClient", "Client", "bare socket", "portal"], 1.0)


def test_bench_start_times_devd_against_both_floors() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "start", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert set(json.loads(done.stdout)) >= {"floor_ms", "floor_core_ms", "devd_ms", "devd_over_floor_core"}


def test_bench_start_phases_attributes_devds_start_to_each_stage_of_its_imports() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "start", "--phases", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    stages = ["startup", "floor", "core", "anyio", "structlog", "wire", "agent", "serve"]
    assert list(json.loads(done.stdout)["cpu_ms"]["devd_stages"]) == stages


def test_bench_sandbox_times_both_sandboxes_against_an_unconfined_command() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "sandbox", "--runs", "2", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    ratios = json.loads(done.stdout)["ratio_to_unconfined"]
    assert (sorted(ratios), ratios["unconfined true"]) == (["bwrap", "none", "unconfined true"], 1.0)


def test_bench_chat_times_devd_chat_against_reading_the_stream_directly() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "chat", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert sorted(json.loads(done.stdout)["p50_ms"]) == ["a watching client", "devd chat", "direct"]


def test_bench_mcp_times_the_broker_against_the_sdks_own_client_and_counts_processes() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "mcp", "--rounds", "1", "--calls", "5", "--sessions", "3"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    result = json.loads(done.stdout)
    sides = ["broker", "broker (http)", "sdk client", "sdk client (http)"]
    assert (sorted(result["ms"]), result["server_processes"], result["sessions"]) == (sides, 1, 3)


def test_bench_mixed_times_session_new_beside_large_steps_against_it_alone() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "mixed", "--rounds", "1", "--seconds", "0.5", "--clients", "2"]
    done = subprocess.run(argv + ["--payload-mib", "1"], capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert sorted(json.loads(done.stdout)["ratio"]) == ["max_ms", "p50_ms", "p99_ms"]


def test_bench_rewind_times_a_rewind_against_the_turn_it_undoes() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "rewind", "--rounds", "1", "--files", "3"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert set(json.loads(done.stdout)) >= {"turn_ms", "rewind_ms", "ratio"}


def test_bench_children_times_a_child_against_the_same_work_without_one_and_fans_out() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "children", "--rounds", "1", "--children", "3"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert json.loads(done.stdout)["fan_out_children_completed"] == 3


def test_bench_stream_measures_every_fragment_of_every_sessions_turn() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "stream", "--sessions", "3", "--tokens", "5", "--rate", "100"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    result = json.loads(done.stdout)["this"]
    assert (result["turns_not_ended"], result["cpu_us_per_fragment"] > 0) == (0, True)


def test_bench_stream_with_several_watchers_a_session_delivers_every_fragment_to_each() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "stream", "--sessions", "3", "--tokens", "5", "--rate", "100"]
    done = subprocess.run([*argv, "--watchers", "3"], capture_output=True, env=daemon_env(), timeout=120, check=True)
    rounds = [json.loads(line) for line in done.stderr.splitlines() if line.startswith(b"{")]
    told = [(r["fragments"], r["fragments_delivered"], r["watchers_not_told_the_end"]) for r in rounds]
    assert told == [(15, 45, 0)]


def test_bench_stream_takes_the_models_rate_as_tokens_per_second() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "stream", "--sessions", "2", "--tokens", "4"]
    done = subprocess.run(
        [*argv, "--tokens-per-second", "200"], capture_output=True, env=daemon_env(), timeout=120, check=True
    )
    assert (json.loads(done.stdout)["rate"], json.loads(done.stdout)["model_s"]) == (200.0, 0.02)


def test_bench_first_times_devd_run_on_a_cold_daemon_and_a_warm_one() -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "first", "--rounds", "1", "--sandbox", "none"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    assert set(json.loads(done.stdout)["this"]) >= {"cold_ms", "warm_ms", "cold_minus_warm_ms"}
