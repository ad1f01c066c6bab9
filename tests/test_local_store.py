"""The local backend's checkpoint store (tinker_local.py, issue 27): checkpoints outlive their server, two
servers at once share them safely (each keeps its own database), the store is bounded and can be pruned.
Offline tests work on a store folder built by hand; the e2e test runs a second server beside the suite's."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tinker_local

LAUNCHER = Path(tinker_local.__file__)
DAY = 86400


def model_folder(home: Path, model_id: str, *, age_days: float = 0, size: int = 1000, server: Path | None = None,
                 ephemeral: bool = False) -> Path:
    """A model folder as a server writes it: model.json, a weights/ save, a sampler save; all `age_days` old."""
    folder = tinker_local.store_dir(home) / model_id
    (folder / "sampler_weights").mkdir(parents=True)
    (folder / "model.json").write_text(json.dumps({"model_id": model_id, "base_model": "Qwen/Qwen3-8B",
                                                   "lora_config": {"rank": 8}, "server": str(server) if server else None}))
    (folder / "final.tar.gz").write_bytes(b"x" * size)
    (folder / "sampler_weights" / "final.tar.gz").write_bytes(b"y" * 10)
    if ephemeral:
        (folder / "sampler_weights" / "ss1_seq4.tar.gz").write_bytes(b"z" * 10)
    stamp = time.time() - age_days * DAY
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (stamp, stamp))
    return folder


@contextlib.contextmanager
def live_server(run_dir: Path):
    """A process standing in for a running server of `run_dir` (its command line names the folder)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(run_dir)])
    (run_dir / "server.json").write_text(json.dumps({"pid": proc.pid}))
    while str(run_dir).encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # until it has exec'd
        time.sleep(0.01)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_prune_deletes_models_untouched_for_the_bound_and_keeps_newer_ones(tmp_path):
    model_folder(tmp_path, "model_old", age_days=31)
    model_folder(tmp_path, "model_new", age_days=29)
    result = tinker_local.prune(tmp_path)
    assert result["removed"] == ["model_old"] and result["models_kept"] == 1
    assert sorted(p.name for p in tinker_local.store_dir(tmp_path).iterdir()) == ["model_new"]


def test_prune_over_the_size_bound_deletes_the_oldest_first(tmp_path):
    for i, age in enumerate((3, 1, 2)):
        model_folder(tmp_path, f"model_{i}", age_days=age, size=400_000)
    result = tinker_local.prune(tmp_path, max_gb=0.9e6 / 2**30)  # room for two of the three
    assert result["removed"] == ["model_0"] and result["bytes_kept"] < 0.9e6


def test_a_model_whose_server_runs_is_never_pruned_even_by_all(tmp_path):
    run_dir = tmp_path / "runs" / "live"
    model_folder(tmp_path, "model_live", age_days=100, server=run_dir)
    model_folder(tmp_path, "model_gone", age_days=100, server=tmp_path / "runs" / "gone")
    (tmp_path / "runs" / "gone").mkdir(parents=True)
    with live_server(run_dir):
        result = tinker_local.prune(tmp_path, everything=True)
    assert result["removed"] == ["model_gone"] and result["kept_because_a_server_uses_them"] == 1
    assert result["run_folders_removed"] == 1 and not (tmp_path / "runs" / "gone").exists()
    assert (run_dir / "server.json").exists()


def test_prune_dry_run_deletes_nothing(tmp_path):
    model_folder(tmp_path, "model_old", age_days=40, ephemeral=True)
    result = tinker_local.prune(tmp_path, dry_run=True)
    assert result["removed"] == ["model_old"] and result["dry_run"] is True
    assert (tinker_local.store_dir(tmp_path) / "model_old" / "sampler_weights" / "ss1_seq4.tar.gz").exists()


def test_sampler_saves_only_their_server_can_use_go_when_it_stops(tmp_path):
    """save_weights_and_get_sampling_client's saves (ss<N>_seq<M>) are dead once their server stops."""
    mine, other = tmp_path / "runs" / "mine", tmp_path / "runs" / "other"
    model_folder(tmp_path, "model_mine", server=mine, ephemeral=True)
    model_folder(tmp_path, "model_other", server=other, ephemeral=True)
    tinker_local.drop_ephemeral_saves(tinker_local.store_dir(tmp_path), owner=mine)
    store = tinker_local.store_dir(tmp_path)
    assert sorted(p.name for p in (store / "model_mine" / "sampler_weights").iterdir()) == ["final.tar.gz"]
    assert (store / "model_other" / "sampler_weights" / "ss1_seq4.tar.gz").exists()


def test_prune_command_prints_one_json_object_and_refuses_all_with_bounds(tmp_path):
    model_folder(tmp_path, "model_old", age_days=40)
    done = subprocess.run([sys.executable, str(LAUNCHER), "prune", "--home", str(tmp_path), "--older-than", "7"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["removed"] == ["model_old"]
    assert "deleted 1 model folder(s)" in done.stderr
    done = subprocess.run([sys.executable, str(LAUNCHER), "prune", "--home", str(tmp_path), "--all", "--max-gb", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert "--all deletes every checkpoint no running server uses" in done.stderr


def test_a_run_dir_a_running_server_uses_is_refused_before_anything_starts(local_backend_install, tmp_path):
    venv, home = local_backend_install
    run_dir = tmp_path / "busy"
    with live_server(run_dir) as proc:
        with pytest.raises(tinker_local.LocalError, match=rf"--run-dir {run_dir} is in use by a running server "
                                                          rf"\(pid {proc.pid}\)"):
            tinker_local.start_server(venv=venv, home=home, run_dir=run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["server.json"]


# ---------------------------------------------------------------- two servers, one store


def train_and_save(service, model, seed):
    """Two steps on one datum, a weights/ and a sampler_weights/ save; (losses, forward loss after, paths)."""
    from tinker import types
    tc = service.create_lora_training_client(model, rank=8, seed=seed).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(100, 130))),
                        loss_fn_inputs={"target_tokens": list(range(101, 131)), "weights": [1.0] * 30})
    losses = []
    for _ in range(2):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    state, sampler = tc.save_state("s1").result().path, tc.save_weights_for_sampler("s1").result().path
    return losses, tc.forward([datum], "cross_entropy").result().metrics["loss:sum"], state, sampler, datum


@pytest.mark.e2e
def test_two_servers_at_once_train_apart_and_serve_each_others_checkpoints(local_tinker, local_backend_install):
    """Each server keeps its own database (no request of one is taken by the other) and both read one store:
    a checkpoint saved on one samples, restores (same loss) and lists on the other while both run."""
    import tinker
    venv, home = local_backend_install
    other = tinker_local.start_server(venv=venv, home=home)
    try:
        clients = {"suite": tinker.ServiceClient(base_url=local_tinker.base_url, api_key="tml-local"),
                   "other": tinker.ServiceClient(base_url=other.base_url, api_key="tml-local")}
        results, errors = {}, []

        def work(name, seed):
            try:
                results[name] = train_and_save(clients[name], local_tinker.model, seed)
            except Exception as e:  # noqa: BLE001 - reported by the assert below
                errors.append(f"{name}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(n, s)) for n, s in (("suite", 1), ("other", 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert errors == [] and set(results) == {"suite", "other"}
        for name, (losses, after, *_rest) in results.items():
            assert losses[1] < losses[0] and after < losses[1], (name, losses, after)
        # Each server serves the other's checkpoints, read from the store.
        for here, there in (("other", "suite"), ("suite", "other")):
            _, after, state, sampler, datum = results[there]
            service = clients[here]
            from tinker import types
            sampled = service.create_sampling_client(model_path=sampler).result().sample(
                types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
            assert len(sampled.sequences[0].tokens) >= 1
            restored = service.create_training_client_from_state_with_optimizer(state).result()
            assert restored.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(after, rel=1e-5)
            run_id = state.split("/")[2]
            listed = tinker.RestClient(base_url=local_tinker.base_url if here == "suite" else other.base_url,
                                       api_key="tml-local").list_checkpoints(run_id).result().checkpoints
            assert {c.tinker_path for c in listed} == {state, sampler}
        owners = {json.loads((tinker_local.store_dir(home) / r[2].split("/")[2] / "model.json").read_text())["server"]
                  for r in results.values()}
        assert str(other.run_dir) in owners and len(owners) == 2  # each model recorded by the server that made it
        for client in clients.values():
            client.close("success").result()
    finally:
        other.stop()
