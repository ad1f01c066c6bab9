#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "httpx>=0.27",
#     "rich>=13",
# ]
# ///
"""Find, export and merge Tinker checkpoints: list, resolve, export, merge.

Run:
    python tinker_checkpoints.py list --run RUN_ID
    python tinker_checkpoints.py resolve logs/my-sft --kind sampler
    python tinker_checkpoints.py export tinker://RUN/sampler_weights/final --out adapter/
    python tinker_checkpoints.py export tinker://RUN/sampler_weights/final --out adapter/ --peft   # vLLM-ready
    python tinker_checkpoints.py merge adapter/ --base path/to/hf-base-model --out merged/

Commands:
    list [--run ID|LOG_DIR]   newest first: path, type, size, expiry (server listing; the
                              local backend has no account-wide listing, so every run's
                              checkpoints are listed instead)
    resolve RUN_ID|LOG_DIR|PATH [--kind sampler|state]   the latest path of that kind (from a
                              tinker:// path: the same save of that kind first)
    export PATH --out DIR     external_weights/: the signed URLs from
                              RestClient.get_external_weights_urls (SDK 0.38's route);
                              weights/: the official `tinker checkpoint download` (it exports
                              through save_weights_external and deletes the copy);
                              sampler_weights/: SDK 0.38 has no route, so the server's
                              archive route GET /api/v1/training_runs/{run}/checkpoints/{name}/archive
                              is tried (the local backend serves it: a tar.gz PEFT adapter),
                              else the error names the same run's weights/ path. Downloads
                              show progress, check Content-Length and any MD5/SHA-256 the
                              server sends, and extract safely (absolute paths, `..` and
                              links leaving DIR are refused before anything is written).
                              Files land in a hidden folder beside DIR that becomes DIR only
                              when complete: a failed export leaves no half-written DIR.
                              adapter_config.json's target_modules is rewritten from the
                              tensors (SkyRL writes null, and PEFT then loads q_proj/v_proj only).
                              --peft: Tinker's names mapped by hf_key() (unembed_tokens ->
                              lm_head); an embedding LoRA or Tinker's own layouts are refused
                              (exit 2) naming the merge.
    merge ADAPTER_DIR --base BASE_DIR --out DIR   merge a PEFT LoRA adapter into the base
                              model's Hugging Face weights (needs torch + peft, an optional
                              extra; install torch first, then `pip install peft safetensors`).
                              Tensor names: Hugging Face/PEFT names, the local backend's
                              (SkyRL) exports, and Tinker's name for the output head,
                              `unembed_tokens` (-> lm_head). A base with tied embeddings is
                              untied when the adapter changes the input embedding or the
                              head, so each keeps only its own update. Tinker's other
                              names (MoE experts w1/w2/w3, gpt-oss `.attn`, Qwen3.5's
                              split in_proj_q/k/v) are refused with the cookbook's
                              weights.build_hf_model as the next step.
    Local backend: checkpoints live in the checkpoint store of its cache folder (any later
    server finds them, for 30 days); weights/ export is unavailable.

Edit:
    Nothing for the common case. To merge an adapter that names modules another way, edit
    `hf_key()` (an adapter tensor name -> the name PEFT finds in the Hugging Face model).

Outputs:
    stdout: exactly one JSON object. list -> {"status", "checkpoints": [{"path", "type", "time",
    "size_bytes", "expires_at", "public"}]}; resolve -> {"status", "path", "kind", "source", ...};
    export -> {"status", "path", "out", "files", "bytes", "route", "target_modules", "peft_ready", "renamed"};
    merge -> {"status", "out",
    "target_modules", "lora_rank", "lora_alpha", "untied_embeddings", "renamed", "copied_files"}.
    On failure: {"status": "error"|"interrupted", "exit_code", "error"} and one line on stderr.

Requires:
    TINKER_API_KEY (starts with tml-) for list, resolve (of a run id) and export; merge and
    resolve of a log folder are offline. TINKER_BASE_URL optional (local rehearsals).
    Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (flags, paths, wrong
    checkpoint kind, unknown checkpoint), 4 no credentials or cannot reach Tinker,
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# ==== SETTINGS (defaults; every one is a flag) ====
DEFAULT_LIST_LIMIT = 100
DOWNLOAD_TIMEOUT_S = 120.0  # per read: a stalled download fails instead of hanging


def parser():
    p = Parser(prog="tinker_checkpoints.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__.split("\n\n", 1)[1].split("Edit:")[0])
    sub = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    ls = sub.add_parser("list", help="checkpoints, newest first: path, type, size, expiry")
    ls.add_argument("--run", metavar="RUN_ID|LOG_DIR", help="only this run's checkpoints")
    ls.add_argument("--limit", type=int, default=DEFAULT_LIST_LIMIT,
                    help=f"at most this many rows (default {DEFAULT_LIST_LIMIT}; 0 = all)")
    ls.add_argument("--json", action="store_true", help="no table on stderr")
    rs = sub.add_parser("resolve", help="the latest checkpoint path of a kind, from a run id or a log folder")
    rs.add_argument("target", metavar="RUN_ID|LOG_DIR|PATH",
                    help="a run id, a log folder, or a tinker:// path (then the same save of --kind comes first)")
    rs.add_argument("--kind", choices=["sampler", "state"], default="sampler",
                    help="sampler: sampler_weights/ (for sampling); state: weights/ (for --resume); default sampler")
    ex = sub.add_parser("export", help="download a checkpoint's files into a folder",
                        description="Routes: external_weights/ via signed URLs (SDK 0.38); weights/ via the official "
                                    "`tinker checkpoint download`; sampler_weights/ via the server's archive route when "
                                    "it offers one (the local backend does), a tar.gz extracted safely.")
    ex.add_argument("path", metavar="PATH", help="tinker://RUN/{weights,sampler_weights,external_weights}/NAME")
    ex.add_argument("--out", required=True, metavar="DIR")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    ex.add_argument("--peft", action="store_true",
                    help="write the adapter as PEFT and vLLM name it: Tinker's names mapped by hf_key() "
                         "(unembed_tokens -> lm_head); a layout PEFT cannot express is refused (exit 2)")
    mg = sub.add_parser("merge", help="merge a PEFT LoRA adapter into Hugging Face base weights (needs torch, peft)")
    mg.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="folder with adapter_config.json + adapter_model.safetensors")
    mg.add_argument("--base", required=True, metavar="BASE_DIR", help="the base model's Hugging Face folder")
    mg.add_argument("--out", required=True, metavar="DIR")
    mg.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                    help="dtype to merge and save in (default auto: the base model's)")
    mg.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


# ==== EDIT ME: hf_key() ====
def hf_key(key: str) -> str:
    """An adapter tensor's name -> the name PEFT finds in the Hugging Face model.

    Tinker names the output head `unembed_tokens`; Hugging Face models call it `lm_head` (the tinker-cookbook's
    weights module maps it the same way). Add a rule here for an adapter that names other modules its own way.
    """
    return key.replace("base_model.model.model.unembed_tokens.", "base_model.model.lm_head.")


# ==== main flow ====
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run_cli(dispatch, argv, error_json=True, interrupted_hint="nothing was written; run the command again")
    except SystemExit as e:  # argparse: --help is 0, a bad flag is 2 (its usage line is on stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def dispatch(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    command = {"list": cmd_list, "resolve": cmd_resolve, "export": cmd_export, "merge": cmd_merge}[args.action]
    print(json.dumps(command(args), ensure_ascii=False, default=str))
    return EXIT_OK


# ==== list / resolve ====
def cmd_list(args) -> dict:
    check_numbers(args, {"limit": dict(low=0)})
    run = run_id_of(args.run) if args.run else None
    require_credentials(dry_run_hint=False)
    check_reachable()
    import tinker

    rest = rest_client()
    try:
        if run:
            checkpoints = list(rest.list_checkpoints(run).result().checkpoints)
        else:
            try:
                checkpoints = list(rest.list_user_checkpoints(limit=args.limit).result().checkpoints)
            except tinker.NotFoundError:
                # Servers without the account-wide listing (the local backend): walk the runs.
                runs = rest.list_training_runs(limit=100).result().training_runs
                checkpoints = []
                for r in runs:
                    try:
                        checkpoints += rest.list_checkpoints(r.training_run_id).result().checkpoints
                    except tinker.APIStatusError as e:  # one unreadable run must not hide the rest
                        say(f"warning: skipped run {r.training_run_id}: {one_line(e, 120)}")
    except Exception as e:
        raise tinker_failure(e, "listing checkpoints", args.run if args.run and args.run.startswith("tinker://") else None)
    checkpoints.sort(key=lambda c: c.time, reverse=True)
    rows = [checkpoint_row(c) for c in checkpoints[: args.limit or None]]
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table("path", "type", "size", "created", "expires")
        for r in rows:
            size = f"{r['size_bytes'] / 1e6:.1f} MB" if r["size_bytes"] else "-"
            table.add_row(r["path"], r["type"], size, (r["time"] or "-")[:19], (r["expires_at"] or "never")[:19])
        # Paths are what people copy: never cut them to the terminal's width.
        width = max([len(r["path"]) for r in rows] + [4]) + 70
        Console(stderr=True, width=max(width, shutil.get_terminal_size().columns)).print(table)
    return {"status": "ok", "checkpoints": rows}


def cmd_resolve(args) -> dict:
    if Path(args.target).is_dir():
        row = latest_row(read_run_record(args.target), args.kind, args.target)
        path = row["sampler_path"] if args.kind == "sampler" else row["state_path"]
        result = {"status": "ok", "path": path, "kind": args.kind, "source": "run record",
                  "step": row.get("step"), "name": row.get("name"), "format": row.get("format")}
    else:
        run = run_id_of(args.target)
        require_credentials(dry_run_hint=False)
        check_reachable()
        wanted = "sampler" if args.kind == "sampler" else "training"
        try:
            checkpoints = rest_client().list_checkpoints(run).result().checkpoints
        except Exception as e:
            raise tinker_failure(e, f"listing the checkpoints of run {run}")
        found = sorted((c for c in checkpoints if c.checkpoint_type == wanted), key=lambda c: c.time, reverse=True)
        if args.target.startswith("tinker://"):  # the other kind of the same save first
            name = parse_tinker_path(args.target)[2]
            found.sort(key=lambda c: c.tinker_path.rsplit("/", 1)[-1] != name)
        if not found:
            kinds = sorted({c.checkpoint_type for c in checkpoints}) or ["none"]
            raise DataError(f"run {run} has no {wanted} checkpoint (it has: {', '.join(kinds)}); "
                            "next: " + script_command("tinker_checkpoints.py", "list", "--run", run))
        result = {"status": "ok", "path": found[0].tinker_path, "kind": args.kind, "source": "server",
                  "time": found[0].time.isoformat()}
    say(result["path"])
    return result


def checkpoint_row(c) -> dict:
    return {"path": c.tinker_path, "type": c.checkpoint_type, "time": c.time.isoformat() if c.time else None,
            "size_bytes": c.size_bytes, "expires_at": c.expires_at.isoformat() if c.expires_at else None,
            "public": c.public}


def run_id_of(arg: str) -> str:
    """A run id from a run id, a tinker:// path or a log folder's run record."""
    if arg.startswith("tinker://"):
        return parse_tinker_path(arg)[0]
    if Path(arg).is_dir():
        row = read_run_record(arg)[-1]
        return parse_tinker_path(row.get("state_path") or row["sampler_path"])[0]
    return arg


# ==== export (download + safe extraction) ====
def cmd_export(args) -> dict:
    run, segment, name = parse_tinker_path(args.path) or (None, None, None)
    if segment is None:
        raise DataError(f"{args.path} is not a tinker:// checkpoint path; next: "
                        + script_command("tinker_checkpoints.py", "list"))
    out = check_writable_dir(args.out, "--out")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise DataError(f"{out} exists and is not empty; pass --overwrite or another --out")
    key = require_credentials(dry_run_hint=False)
    check_reachable()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Everything lands in a hidden folder beside --out first: a failed export leaves no half-written --out.
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        if segment == "external_weights":
            result = export_external(args.path, staging)
        elif segment == "weights":
            result = export_state_with_cli(args.path, staging, out)
        else:
            result = export_sampler_archive(args.path, staging, out, key)
        result.update(complete_adapter(staging, peft=args.peft, fix=export_fix(args.path, args.out, args.peft)))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except UnsafeArchive as e:
        raise ScriptError(str(e)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"exported {args.path} -> {out} ({len(result['files'])} files, {result['bytes']} bytes, via {result['route']})")
    return {"status": "ok", "path": args.path, "out": str(out), **result}


class UnsafeArchive(Exception):
    """An archive or file list that would write outside the target folder: nothing is written."""

    exit_code = 1  # a runtime failure (EXIT_FAILURE): the server sent it; the user's input was fine


class DownloadError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def safe_extract(archive: str | Path, target: str | Path) -> list[str]:
    """Extract a tar archive into target, refusing it whole if any entry would land outside.

    Refused before anything is written: absolute names, names that climb out with `..`,
    symbolic or hard links whose target leaves `target`, devices and FIFOs.
    """
    target = Path(target).resolve()
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            name = m.name
            if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
                raise UnsafeArchive(f"refusing archive {archive}: absolute path {name!r}")
            dest = (target / name).resolve()
            if not dest.is_relative_to(target):
                raise UnsafeArchive(f"refusing archive {archive}: {name!r} leaves the target folder")
            if m.issym():
                link = Path(m.linkname)
                resolved = link.resolve() if link.is_absolute() else (dest.parent / link).resolve()
                if not resolved.is_relative_to(target):
                    raise UnsafeArchive(f"refusing archive {archive}: link {name!r} -> {m.linkname!r} points outside")
            elif m.islnk():
                if os.path.isabs(m.linkname) or not (target / m.linkname).resolve().is_relative_to(target):
                    raise UnsafeArchive(f"refusing archive {archive}: hard link {name!r} -> {m.linkname!r} points outside")
            elif not (m.isfile() or m.isdir()):
                raise UnsafeArchive(f"refusing archive {archive}: {name!r} is a device or FIFO")
        target.mkdir(parents=True, exist_ok=True)
        # The "data" filter repeats these checks inside tarfile and drops unsafe modes.
        tar.extractall(target, filter="data")
        return sorted(m.name for m in members if m.isfile())


def expected_digests(headers) -> dict[str, str]:
    """Checksums a server may send: Content-MD5, x-goog-hash md5=, Digest sha-256=, x-checksum-sha256."""
    digests = {}
    if headers.get("content-md5"):
        digests["md5"] = base64.b64decode(headers["content-md5"]).hex()
    for part in (headers.get("x-goog-hash") or "").split(","):
        if part.strip().startswith("md5="):
            digests["md5"] = base64.b64decode(part.strip()[4:]).hex()
    for part in (headers.get("digest") or "").split(","):
        if part.strip().lower().startswith("sha-256="):
            digests["sha256"] = base64.b64decode(part.strip()[8:]).hex()
    if headers.get("x-checksum-sha256"):
        digests["sha256"] = headers["x-checksum-sha256"].lower()
    return digests


def download(url: str, dest: Path, headers: dict | None = None, label: str = "") -> int:
    """Stream url to dest with a progress bar; verify length and any checksum offered."""
    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    hashes = {"md5": hashlib.md5(), "sha256": hashlib.sha256()}
    size = 0
    try:
        with httpx.stream("GET", url, headers=headers or {}, follow_redirects=True, timeout=DOWNLOAD_TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()
                raise DownloadError(response.status_code, server_message(response))
            total = int(response.headers.get("content-length") or 0) or None
            digests = expected_digests(response.headers)
            with open(dest, "wb") as f, Progress("{task.description}", BarColumn(), DownloadColumn(),
                                                 TransferSpeedColumn(), console=Console(stderr=True),
                                                 transient=True) as progress:
                task = progress.add_task(label or dest.name, total=total)
                for chunk in response.iter_bytes(1 << 20):
                    f.write(chunk)
                    size += len(chunk)
                    for h in hashes.values():
                        h.update(chunk)
                    progress.update(task, advance=len(chunk))
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # DNS failure, refused: nothing was received
        host = httpx.URL(url).host
        raise AccessError(f"cannot download {label or dest.name}: cannot reach {host} ({one_line(e, 120)}); "
                          "check the network, then run the export again") from None
    except httpx.TransportError as e:  # cut off mid-transfer: the staging folder is discarded
        raise ScriptError(f"download of {label or dest.name} stopped at {size} bytes ({type(e).__name__}: "
                          f"{one_line(e, 120)}); next: run the export again") from None
    if total is not None and size != total:
        raise ScriptError(f"download of {label or url} stopped at {size} of {total} bytes; next: run the export again")
    for algo, want in digests.items():
        if hashes[algo].hexdigest() != want:
            raise ScriptError(f"{label or dest.name}: {algo} mismatch (got {hashes[algo].hexdigest()}, server said "
                              f"{want}); the download is corrupt; next: run the export again")
    return size


def export_sampler_archive(path: str, dest: Path, out: Path, key: str) -> dict:
    run, _, name = parse_tinker_path(path)
    url = f"{service_url()}/api/v1/training_runs/{run}/checkpoints/{name}/archive"
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        archive = Path(tmp) / "checkpoint.tar.gz"
        try:
            size = download(url, archive, headers={"X-API-Key": key}, label=f"{name}.tar.gz")
        except DownloadError as e:
            if e.status in (401, 403):
                raise AccessError(f"the server refused the API key for {url} ({e})") from None
            states = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "training"]
            hint = ("export the run's resumable state instead: "
                    + script_command("tinker_checkpoints.py", "export", states[0], "--out", out)
                    if states else "save_state() a weights/ checkpoint of the run and export that")
            raise DataError(f"{path} cannot be downloaded here ({e}): SDK 0.38 has no download route for "
                            f"sampler_weights/; {hint}") from None
        files = safe_extract(archive, dest)
    return {"route": "archive", "files": files, "bytes": size}


def export_external(path: str, dest: Path) -> dict:
    try:
        signed = rest_client().get_external_weights_urls(path).result()
    except Exception as e:
        raise tinker_failure(e, f"signing the download URLs of {path}", path)
    total, files = 0, []
    base = dest.resolve()
    for name, url in sorted(signed.urls.items()):
        target = (dest / name).resolve()
        if not target.is_relative_to(base):
            raise UnsafeArchive(f"refusing {path}: file name {name!r} leaves the --out folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            total += download(url, target, label=name)
        except DownloadError as e:
            raise ScriptError(f"downloading {name} of {path} failed ({e}); next: run the export again") from None
        files.append(name)
    return {"route": "external_weights_urls", "files": files, "bytes": total}


def export_state_with_cli(path: str, dest: Path, out: Path) -> dict:
    """The official CLI already does this right (export -> download -> delete the copy)."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "tinker.cli", "-f", "json", "checkpoint", "download", path, "-o", tmp]
        say("running: tinker -f json checkpoint download", path)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            run = parse_tinker_path(path)[0]
            samplers = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "sampler"]
            hint = ("; if this server has no external-weights export (the local backend has none), export "
                    "the run's sampler checkpoint: "
                    + script_command("tinker_checkpoints.py", "export", samplers[0], "--out", out) if samplers else "")
            raise ScriptError(f"`tinker checkpoint download {path}` failed: {last}{hint}")
        folders = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(folders) != 1:
            raise ScriptError(f"`tinker checkpoint download` left {len(folders)} folders; expected one")
        files = []
        for f in sorted(folders[0].rglob("*")):
            if f.is_file():
                rel = f.relative_to(folders[0])
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(f), dest / rel)
                files.append(str(rel))
    return {"route": "tinker checkpoint download", "files": files,
            "bytes": sum((dest / f).stat().st_size for f in files)}


# ==== the exported adapter: adapter_config.json completed; --peft: the form PEFT and vLLM load ====
EMBEDDING_MODULES = ("embed_tokens", "wte", "word_embeddings")


def complete_adapter(folder: Path, *, peft: bool, fix: str) -> dict:
    """Make the exported adapter say what it holds, before it becomes --out.

    `target_modules` is listed from the tensors: SkyRL's exports (the local backend) write null, and PEFT then
    falls back to its per-architecture default (q_proj and v_proj for Llama and Qwen) and drops every other
    tensor without a warning. With --peft the tensors are also renamed by hf_key() (Tinker's unembed_tokens ->
    lm_head), and a layout PEFT or vLLM cannot take is refused (exit 2) naming `fix`. Reads only the safetensors
    header: no torch needed."""
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not (config_file.is_file() and weights_file.is_file()):
        if peft:
            raise DataError("--peft: the checkpoint holds no PEFT adapter (expected adapter_config.json and "
                            f"adapter_model.safetensors, got {', '.join(sorted(p.name for p in folder.iterdir()))})")
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        header, _ = safetensors_header(weights_file)
    except (ValueError, UnicodeDecodeError, OSError) as e:  # length and checksums matched: the server sent this
        raise ScriptError(f"the exported adapter is unreadable ({one_line(e, 150)}), so its target_modules cannot be "
                          "listed; nothing was written to --out; next: run the export again") from None
    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    names = {k: hf_key(k) for k in shapes}
    renamed = sorted({k.rsplit(".lora_", 1)[0] for k, v in names.items() if v != k})
    problems = peft_problems({names[k]: s for k, s in shapes.items()}) + tinker_layouts(shapes)
    if peft:
        if problems:
            raise DataError(f"--peft: not written, the adapter has {'; '.join(problems)}; {fix}")
        if len(set(names.values())) != len(names):
            raise DataError(f"--peft: hf_key() maps two tensors to one name; fix the rule in hf_key(); {fix}")
        if renamed:
            rename_safetensors(weights_file, names)
            shapes = {names[k]: s for k, s in shapes.items()}
            say(f"Tinker's names mapped to Hugging Face's (hf_key()): {', '.join(renamed)}")
    targets = adapter_target_modules(shapes)
    if not targets:
        if peft:
            raise DataError(f"--peft: {weights_file.name} holds no lora_A/lora_B tensors; expected a LoRA adapter")
        say(f"warning: {weights_file.name} holds no lora_A/lora_B tensors; adapter_config.json left as it was")
        return {"target_modules": config.get("target_modules"), "peft_ready": False, "renamed": []}
    if peft:
        ranks = sorted({s[0] for k, s in shapes.items() if k.endswith((".lora_A.weight", ".lora_embedding_A"))})
        if len(ranks) != 1:
            raise DataError(f"--peft: the adapter's LoRA ranks differ between modules ({ranks}); {fix}")
        config["r"] = ranks[0]
        config["peft_type"] = config.get("peft_type") or "LORA"
        config["task_type"] = config.get("task_type") or "CAUSAL_LM"
    declared = config.get("target_modules")
    config["target_modules"] = targets
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if declared != targets:
        say(f"adapter_config.json: target_modules {declared} -> {targets} (from the tensors)")
    ready = peft or not (problems or renamed)
    if not ready:
        why = "; ".join(problems) if problems else "Tinker's names: " + ", ".join(renamed)
        say(f"note: PEFT and vLLM cannot load this adapter as written ({why}); "
            + (fix if problems else "next: export it again with --peft"))
    return {"target_modules": targets, "peft_ready": ready, "renamed": renamed if peft else []}


def export_fix(path: str, out: str, peft: bool) -> str:
    """The next step for an adapter PEFT or vLLM cannot take: merged into the base model (or the cookbook's
    converter); after a refused --peft, the export without it comes first."""
    merge = script_command("tinker_checkpoints.py", "merge", out, "--base", "BASE_DIR", "--out", "merged/")
    first = script_command("tinker_checkpoints.py", "export", path, "--out", out) + " && " if peft else ""
    return (f"next: {'export without --peft and ' if peft else ''}merge it into the base model: {first}{merge}; "
            "or convert it with the tinker-cookbook's weights.build_lora_adapter (pip install tinker-cookbook)")


def peft_problems(shapes: dict) -> list[str]:
    """What keeps a PEFT-named adapter (after hf_key()) from loading in PEFT and vLLM as written."""
    problems = []
    outside = [k for k in shapes if not k.startswith("base_model.model.")]
    if outside:
        problems.append(f"tensors outside base_model.model. (first {outside[0]})")
    embedding = [k for k in shapes if any(f".{m}.lora_" in k for m in EMBEDDING_MODULES)]
    if embedding:
        problems.append(f"an input-embedding LoRA (first {embedding[0]}): vLLM takes one only for some models "
                        "and versions, and SkyRL saves it in a linear layer's layout PEFT does not read")
    return problems


def tinker_layouts(shapes: dict) -> list[str]:
    """Tinker's own layouts, which no hf_key() rename makes PEFT's (the cookbook converts them)."""
    signs = {"3-D expert tensors": [k for k, s in shapes.items() if len(s) != 2],
             "expert names w1/w2/w3": [k for k in shapes if any(f".experts.{w}." in k for w in ("w1", "w2", "w3"))],
             "gpt-oss's .attn": [k for k in shapes if ".attn." in k and ".self_attn." not in k and ".layers." in k],
             "split in_proj_q/k/v": [k for k in shapes if any(f".in_proj_{x}." in k for x in "qkv")]}
    return [f"Tinker's own layout ({what}, first {keys[0]})" for what, keys in signs.items() if keys]


def safetensors_header(path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets) and where its data starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 1 << 27:
            raise ValueError(f"{Path(path).name} is not a safetensors file (header of {size} bytes)")
        return json.loads(f.read(size)), 8 + size


def rename_safetensors(path: Path, names: dict) -> None:
    """Rename tensors in place: a new header with the same offsets, the data bytes copied as they are."""
    header, start = safetensors_header(path)
    raw = json.dumps({names.get(k, k): v for k, v in header.items()}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads its header with spaces to 8 bytes
    tmp = path.with_name(path.name + ".renamed")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(len(raw).to_bytes(8, "little") + raw)
        src.seek(start)
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, path)


# ==== merge (optional extra: torch + peft) ====
def cmd_merge(args) -> dict:
    adapter, base_dir = Path(args.adapter_dir), Path(args.base)
    config_file = adapter / "adapter_config.json"
    weights_file = adapter / "adapter_model.safetensors"
    if not config_file.is_file() or not (weights_file.is_file() or (adapter / "adapter_model.bin").is_file()):
        raise DataError(f"{adapter} is not a PEFT adapter (needs adapter_config.json and adapter_model.safetensors); "
                        "next: " + script_command("tinker_checkpoints.py", "export",
                                                  "tinker://RUN_ID/sampler_weights/NAME", "--out", adapter))
    if not (base_dir / "config.json").is_file():
        raise DataError(f"--base {base_dir} has no config.json; expected the base model's Hugging Face folder")
    out = check_writable_dir(args.out, "--out")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise DataError(f"{out} exists and is not empty; pass --overwrite or another --out")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{config_file} is not JSON ({one_line(e, 120)}); export the adapter again") from None
    try:
        import torch
        import peft
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ScriptError(f"merge needs torch and peft ({e.name} is missing); next: install torch for your "
                          "machine first (pip install torch), then pip install 'peft>=0.13' safetensors") from None
    state = (load_file(str(weights_file)) if weights_file.is_file()
             else torch.load(adapter / "adapter_model.bin", map_location="cpu", weights_only=True))
    renamed = sorted({k.rsplit(".lora_", 1)[0] for k in state if hf_key(k) != k})
    state = {hf_key(k): v for k, v in state.items()}
    targets = adapter_target_modules(state)
    declared = config.get("target_modules")
    # The tensors say what was trained. SkyRL's exports (the local backend) name no
    # target_modules, and a pattern such as "all-linear" leaves out lm_head, which Tinker
    # trains by default: with either, PEFT would silently drop tensors.
    if not targets:
        raise DataError(f"{weights_file.name} holds no lora_A/lora_B tensors; expected a PEFT LoRA adapter")
    if renamed:
        say(f"Tinker's names mapped to Hugging Face's (hf_key()): {', '.join(renamed)}")
    if declared != targets:
        say(f"target modules from the adapter's tensors: {', '.join(targets)} (adapter_config.json says {declared})")
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    say(f"loading {base_dir} ({args.dtype}) ...")
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    untied = False
    if getattr(model.config, "tie_word_embeddings", False) and {"embed_tokens", "wte", "word_embeddings",
                                                                  "lm_head"} & set(targets):
        # A LoRA on the input embedding leaves the output head alone, and one on the head (Tinker's
        # unembed_tokens) leaves the input embedding alone; merged into one shared matrix either would
        # move both. The head gets its own copy of the base matrix. (The cookbook's build_hf_model keeps
        # the tie and adds the head's update to the shared matrix, moving the input embedding too.)
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.tie_word_embeddings = False
        untied = True
    lora_config = peft.LoraConfig(
        r=int(config.get("r", 8)), lora_alpha=float(config.get("lora_alpha", 8)), lora_dropout=0.0,
        target_modules=targets, bias=config.get("bias", "none"),
        use_rslora=bool(config.get("use_rslora", False)), fan_in_fan_out=bool(config.get("fan_in_fan_out", False)))
    state = peft_embedding_layout(state, model, torch)  # before PEFT wraps the embedding
    try:
        peft_model = peft.get_peft_model(model, lora_config)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise not_merged(f"the adapter's modules ({', '.join(targets)}) match no module of {base_dir} "
                         f"({one_line(e, 150)})", state, base_dir) from None
    state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
    try:
        loaded = peft.set_peft_model_state_dict(peft_model, state)
    except RuntimeError as e:  # a tensor whose shape fits no module of that name
        raise not_merged(f"the adapter's tensors do not fit {base_dir} ({one_line(e, 150)})", state, base_dir) from None
    unexpected = [k for k in getattr(loaded, "unexpected_keys", []) if "lora" in k]
    if unexpected:
        raise not_merged(f"{len(unexpected)} adapter tensors match no module of {base_dir} (first: {unexpected[0]})",
                         state, base_dir)
    missing = [k for k in getattr(loaded, "missing_keys", []) if "lora_" in k]
    if missing:
        say(f"warning: {len(missing)} LoRA tensors absent from the adapter stay zero (first: {missing[0]})")
    merged = peft_model.merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:  # saved beside --out and renamed: an interrupted merge leaves no half-written --out
        merged.save_pretrained(str(staging), safe_serialization=True)
        copied = []
        for f in sorted(base_dir.iterdir()):
            weights = f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")
            if f.is_file() and not weights and f.name != "config.json" and not (staging / f.name).exists():
                shutil.copy2(f, staging / f.name)
                copied.append(f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"merged {adapter} into {base_dir} -> {out} (r={lora_config.r}, alpha={lora_config.lora_alpha}, "
        f"modules: {', '.join(lora_config.target_modules)}{', untied embeddings' if untied else ''})")
    return {"status": "ok", "out": str(out), "target_modules": sorted(lora_config.target_modules),
            "lora_rank": lora_config.r, "lora_alpha": lora_config.lora_alpha, "untied_embeddings": untied,
            "renamed": renamed, "copied_files": copied}


def adapter_target_modules(keys) -> list[str]:
    """Module names a PEFT LoRA state dict touches, e.g. ...self_attn.q_proj.lora_A.weight -> q_proj."""
    names = set()
    for key in keys:
        parts = key.split(".")
        for i, p in enumerate(parts):
            if p in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B") and i > 0:
                names.add(parts[i - 1])
    return sorted(names)


def not_merged(detail: str, state: dict, base_dir) -> ScriptError:
    """Why the tensors did not fit --base: Tinker's own layout where the names show one that hf_key() does not
    map (the cookbook's converter is the next step), else the question whether --base is the right model."""
    found = tinker_layouts({k: tuple(getattr(v, "shape", (0, 0))) for k, v in state.items()})
    if found:
        return ScriptError(f"{detail}: the adapter uses {'; '.join(found)}, which this merge "
                           "does not convert; merge it with the tinker-cookbook's weights.build_hf_model "
                           "(pip install tinker-cookbook), or map the names in hf_key()")
    return ScriptError(f"{detail}; is --base ({base_dir}) the model this adapter was trained on?")


def peft_embedding_layout(state: dict, model, torch) -> dict:
    """Embedding LoRA saved like a linear layer (SkyRL: `embed_tokens.lora_A.weight` [vocab, r],
    `lora_B.weight` [r, hidden]) -> PEFT's `lora_embedding_A` [r, vocab] / `lora_embedding_B`
    [hidden, r]. Both give the same update: delta[token] = A[token] @ B * alpha / r."""
    embeddings = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    converted = {}
    for key, tensor in state.items():
        head, _, tail = key.rpartition(".lora_")
        module = head.removeprefix("base_model.model.")
        if module in embeddings and tail in ("A.weight", "B.weight"):
            key, tensor = f"{head}.lora_embedding_{tail[0]}", tensor.T.contiguous()
        converted[key] = tensor
    return converted


# ==== SHARED CODE (generated from common/: rehearsal, errors, flags, render, run_files, run_record, service, checkpoints) ====
# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;
# tests/test_shared_code.py fails when this copy differs from its source. Only the definitions the code
# above uses (directly or through each other) are copied.


# ---- common/rehearsal.py ----
# The free rehearsal (--rehearse) on the local backend: which model stands in, each script's preset for it, and the
# shape of the rehearsal's checks.
#
# `tinker_local.py run` exports TINKER_LOCAL_STAND_IN, the model standing in for the named one:
# - the tiny random Qwen3 (default): the named model's exact tokenizer and chat template, so masks, token counts and
#   datums are Qwen3's; it memorises a few short answers and nothing more;
# - SmolLM2-135M-Instruct (`tinker_local.py run --real`): a real, weak instruct model with its own tokenizer and ChatML
#   template; it follows a prompt, learns a user's answers, earns a user's reward and calls a tool after a warm-up.
# Each preset below was measured on its model (references/setup.md, "Which model to rehearse on").
import os
from urllib.parse import urlsplit

STAND_IN_ENV = "TINKER_LOCAL_STAND_IN"
TINY_STAND_IN = "tiny-qwen3"


def stand_in() -> str | None:
    """The model standing in on the local backend (from the launcher), or None (Tinker, or an unknown server)."""
    return os.environ.get(STAND_IN_ENV) or None


def real_stand_in() -> bool:
    """True when a real model (`tinker_local.py run --real`) stands in: the rehearsal judges the user's task."""
    return stand_in() not in (None, TINY_STAND_IN)


def on_local_backend() -> bool:
    """TINKER_BASE_URL points at this machine: the local backend (scripts/tinker_local.py), not Tinker."""
    return urlsplit(os.environ.get("TINKER_BASE_URL") or "").hostname in ("127.0.0.1", "localhost", "::1")


def backend_record() -> dict:
    """What config.json says about where a run trained: {"kind": "local"|"tinker", "stand_in", "stand_in_kind"}.
    A loopback TINKER_BASE_URL without the launcher's variable is local with an unknown stand-in."""
    name = stand_in()
    local = name is not None or on_local_backend()
    return {"kind": "local" if local else "tinker", "stand_in": name,
            "stand_in_kind": None if name is None else "real" if real_stand_in() else "tiny"}


# ---- common/errors.py ----
# Errors and exit codes: every script fails with one line on stderr and a documented exit code.
import argparse
import atexit
import json
import os
import signal
import sys
from pathlib import Path


# 0 ok · 1 Tinker or runtime failure · 2 bad input or usage · 3 estimate above --max-usd ·
# 4 no credentials / Tinker unreachable · 130 interrupted (SIGINT) · 143 terminated (SIGTERM)
EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_OVER_BUDGET, EXIT_NO_ACCESS = 0, 1, 2, 3, 4


class ScriptError(Exception):
    """A failure explained in one line: what failed, what was expected, the next command."""

    exit_code = EXIT_FAILURE


class DataError(ScriptError):
    """Bad input or usage: data, flags, paths, unknown model, context overflow."""

    exit_code = EXIT_BAD_INPUT


class BudgetError(ScriptError):
    exit_code = EXIT_OVER_BUDGET


class AccessError(ScriptError):
    """No credentials, credentials refused, or the service cannot be reached."""

    exit_code = EXIT_NO_ACCESS


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the script is so `finally` blocks and the run record close cleanly."""


def _raise_terminated(signum, frame):
    raise Terminated()


def say(*parts) -> None:
    """Progress and warnings: stderr, so stdout carries only the final JSON object."""
    print(*parts, file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    """The one JSON object a script prints on stdout."""
    print(json.dumps(obj), flush=True)


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:limit]


RESUME_HINT = "the run record is saved; continue with the same command plus --resume"

# ---- next commands: printed as the user can run them, from where they stand

LOCAL_HINT = "for a free rehearsal start the local backend:"


def short_path(path) -> str:
    """A path to type from the working directory: relative when it climbs at most one folder, else absolute."""
    path = Path(path).resolve()
    rel = os.path.relpath(path)
    return rel if not rel.startswith(os.path.join("..", "..")) else str(path)


def sibling_script(name: str) -> str | None:
    """The path to type, from where the user stands, for `name` (another script of this bundle) beside this
    script; None when it is not beside it. Built on the script's path as the user typed it (sys.argv[0]), so a
    script copied into a project names its neighbours there, not the bundle's scripts/ folder."""
    here = Path(__file__).resolve()
    if not (here.parent / name).exists():
        return None
    folder = script_folder()
    return os.path.join(folder, name) if folder not in ("", ".") else name


def local_launcher() -> str | None:
    """The path to type for tinker_local.py: the one that started the local backend this script talks to
    (TINKER_LOCAL_LAUNCHER, set by `tinker_local.py run|serve`), else one beside this script, else None."""
    launcher = os.environ.get("TINKER_LOCAL_LAUNCHER")
    if launcher and Path(launcher).exists():
        return short_path(launcher)
    return sibling_script("tinker_local.py")


def python_command(script, *args) -> str:
    """The shell command that runs `script` (a path) with `args` under the interpreter running this script
    (sys.executable), shell-quoted: it works as printed with no venv activated, where a bare `python` may be
    another interpreter without the SDK (No module named 'tinker')."""
    import shlex

    return shlex.join([sys.executable or "python3", str(script), *map(str, args)])


def script_command(name: str, *args, server: bool = True) -> str:
    """The command that runs `name` (a bundle script) with ARGS: this interpreter, and the script beside this one,
    else beside the local backend's launcher (the bundle's scripts/), else where it belongs beside this one (copy
    it there from the bundle's scripts/ folder). On the local backend it is wrapped in `tinker_local.py run --`,
    which reaches the same checkpoint store, unless server=False (a command that never calls Tinker, e.g.
    `tinker_pricing.py list`)."""
    path = sibling_script(name)
    launcher = local_launcher()
    if path is None and launcher and (Path(launcher).parent / name).exists():
        path = os.path.join(os.path.dirname(launcher), name)
    command = python_command(path or os.path.join(script_folder(), name), *args)
    return under_launcher(command) if server else command


def under_launcher(command: str) -> str:
    """`command` wrapped in `tinker_local.py run [--real] --` when this script runs under the launcher: the
    same model stands in again and the same checkpoint store answers."""
    launcher = local_launcher()
    if launcher and os.environ.get("TINKER_LOCAL_LAUNCHER"):
        return f"{python_command(launcher, 'run', *(['--real'] if real_stand_in() else []), '--')} {command}"
    return command


def script_folder() -> str:
    """This script's folder as the user typed it (sys.argv[0]), else as a path to type from here."""
    here = Path(__file__).resolve()
    typed = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.dirname(typed) if typed and Path(typed).resolve() == here else short_path(here.parent)


def this_command(argv=None) -> str:
    """The command line that started this script (or `argv`, an edited copy of it), as the user typed it, under
    this interpreter."""
    argv = sys.argv if argv is None else argv
    return python_command(*argv) if argv and argv[0].endswith(".py") else "<this command>"


def local_hint() -> str:
    """How to rehearse this very command for free: wrapped in the local backend's launcher. A script copied
    without tinker_local.py says so, and names the command that works once the launcher is copied beside it."""
    launcher = local_launcher()
    if launcher is None:
        folder = script_folder()
        return (f"{LOCAL_HINT} tinker_local.py is not beside this script; copy tinker_local.py and "
                f"tinker_local_server.py from the tinker-training-inference bundle's scripts/ folder into "
                f"{os.path.abspath(folder or '.')}, then run "
                f"{python_command(os.path.join(folder, 'tinker_local.py'), 'run', '--')} {this_command()}")
    return f"{LOCAL_HINT} {python_command(launcher, 'run', '--')} {this_command()}"


def run_cli(main, argv=None, *, error_json: bool = False, interrupted_hint: str = RESUME_HINT) -> int:
    """Run main(argv) and turn every way it can end into an exit code and at most one stderr line.
    error_json: also print {"status": "error"|"interrupted", "exit_code", "error"} on stdout, for a script
    whose stdout always ends in one JSON object (tinker_infer.py); interrupted_hint: what to do after ^C."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return main(argv)
    except ScriptError as e:
        code, status, line = e.exit_code, "error", f"error: {one_line(e, 2000)}"
    except Terminated:
        code, status, line = 143, "interrupted", f"terminated: {interrupted_hint}"
    except KeyboardInterrupt:
        code, status, line = 130, "interrupted", f"interrupted: {interrupted_hint}"
    except Exception as e:  # Tinker or runtime failure: one line; the SDK's log has the details
        code, status, line = EXIT_FAILURE, "error", f"error: {type(e).__name__}: {one_line(e)}"
    say(line)
    if error_json:
        emit({"status": status, "exit_code": code, "error": line.split(": ", 1)[1] if status == "error" else line})
    return code


def teardown_can_abort() -> bool:
    """Whether interpreter teardown can abort this process: the SDK's HTTP transport (pyqwest) is loaded and
    CPython is older than 3.14 (see exit_process)."""
    return "pyqwest" in sys.modules and sys.version_info < (3, 14)


def exit_process(code: int | None):
    """End the script with `code`: sys.exit, except when the SDK's HTTP transport is loaded on CPython < 3.14,
    where the atexit handlers run, stdout and stderr are flushed and the process ends without interpreter
    teardown (os._exit). Why: tinker 0.38 sends its requests through pyqwest, whose Rust threads hand each
    response chunk to Python; one that lands while CPython < 3.14 tears the interpreter down makes glibc abort
    the process (exit 134, -6 from subprocess, nothing on stderr) after all the work is done and reported
    [pyqwest issue 164, PyO3 issue 6084]. A Ctrl-C during a request or a heartbeat in flight at the end
    hits it; seen in 2 of 1,127 test runs."""
    if not teardown_can_abort():
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # as sys.exit("message") does: the message, then 1
        print(code, file=sys.stderr)
    try:
        atexit._run_exitfuncs()  # logging.shutdown and every other atexit handler, as a normal exit would
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0 if code is None else code if isinstance(code, int) else EXIT_FAILURE)


class Parser(argparse.ArgumentParser):
    """argparse whose usage error is one line naming --help (exit 2), not the usage block."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"error: {self.prog}: {message}; see {self.prog} --help\n")


# ---- common/flags.py ----
# Flag checks shared by the dry run and the real run: run before any file changes or any paid call.
import math
import os
import shutil
from pathlib import Path


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_number(dest: str, value, *, low=None, high=None, low_open=False, high_open=False) -> None:
    """DataError unless value is a finite number within [low, high] (open ends where asked); None passes."""
    if value is None:
        return
    name = flag_name(dest)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{name} {value!r}: expected a finite number")
    bounds = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
              f"{'inf' if high is None else high}{')' if high_open else ']'}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise DataError(f"{name} {value}: expected a value in {bounds}")


def check_numbers(args, rules: dict) -> None:
    """rules: {dest: dict(low=..., high=..., low_open=..., high_open=...)} checked against args.dest."""
    for dest, bounds in rules.items():
        check_number(dest, getattr(args, dest, None), **bounds)


def check_writable_dir(path, what: str) -> Path:
    """A folder that exists and is writable, or can be created under a writable parent."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DataError(f"{what} {path} is a file; expected a folder (choose another {what})")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise DataError(f"{what} {path}: {probe} is a file, so the folder cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise DataError(f"{what} {path}: {probe} is not writable (permissions)")
    return p


def check_free_space(path, need_bytes: int, what: str, fix: str) -> None:
    """DataError when the disk that holds `path` (or its nearest existing parent) has less than need_bytes
    free: checked before any paid call, so a full disk never stops a run midway."""
    probe = Path(path).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: the write itself will say
    if free < need_bytes:
        raise DataError(f"{what} needs about {need_bytes / 2**20:,.0f} MiB on the disk of {path} and "
                        f"{free / 2**20:,.0f} MiB are free; {fix}")


# ---- common/render.py ----
# Tokenizer loading, the run record's "format", and rendering through the model's own chat template.
#
# The masking rule: a datum's weights are 1 exactly on what the model must produce after the generation
# prompt (the assistant's tokens, end-of-turn token included) and 0 on everything else. Rendering is
# deterministic: the date a template prints is frozen, so a resumed run renders the same datums.
import os


def tokenizer_record(name_or_path: str) -> str:
    """An existing folder as an absolute path, so tinker_infer.py --run finds it from any directory;
    a hub name unchanged."""
    return os.path.abspath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


# ---- common/run_files.py ----
# A run folder's files at the lowest level, carried by every script that reads or writes one (the report
# tool too): JSONL lines as editors save them, and the one-writer lock.
#
# The lock: an exclusive advisory POSIX record lock (lockf) on LOG/.lock, held for the writer's whole life.
# The kernel drops it when its process ends, however it ends (SIGKILL too), and forked workers (the render
# pool) do not inherit it. The file says who holds it (pid, host, script, start time) for the error a second
# writer prints and for readers (tinker_report.py), which never take the lock: they test it for an instant.
# A record left by a process that died holding the lock is taken over by the next writer, which says so.
# Within one process a POSIX lock never conflicts with itself and closing any descriptor of the file drops
# it: only the lock's own code opens LOG/.lock.
import errno
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the scripts run, unguarded
    fcntl = None

LOCK_FILE = ".lock"
# A reader tests the lock for microseconds and a writer records itself right after taking it: a refused
# writer that finds no live holder named in the file tries again for this long before giving up.
SETTLE_S = 2.0


def jsonl_lines(text: str):
    """(line number, line) of each non-blank line of JSONL text: a UTF-8 byte-order mark (Windows editors,
    also where files were concatenated) and CRLF endings are accepted, as pandas and datasets accept them;
    only a newline ends a line (U+2028 and other characters str.splitlines() splits on are valid inside a
    JSON string)."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.strip().lstrip("\ufeff")
        if line:
            yield n, line


class FolderBusy(Exception):
    """A live process holds the folder's lock; `holder` is its record ({} when unreadable)."""

    def __init__(self, holder: dict):
        super().__init__(describe_holder(holder))
        self.holder = holder


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it has not recorded itself yet)"
    return (f"{holder.get('script') or 'a script'} (pid {holder['pid']} on host {holder.get('host')}, "
            f"since {holder.get('started')})")


def read_holder(fd) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder_alive(holder: dict) -> bool | None:
    """Whether the recorded process still runs: True/False on this host, None for another host."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd, path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def acquire_lock(folder) -> tuple[int | None, dict]:
    """(descriptor holding FOLDER/.lock, the record of a dead holder taken over or {}). Creates the folder.
    FolderBusy when a live process holds it. Release with release_lock(fd, folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return None, {}
    path = folder / LOCK_FILE
    deadline = time.monotonic() + SETTLE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = read_holder(fd)
            os.close(fd)
            if holder_alive(holder) or time.monotonic() > deadline:
                raise FolderBusy(holder) from None
            time.sleep(0.05)
            continue
        if not _same_file(fd, path):  # released and removed between our open and lock: lock the new file
            os.close(fd)
            continue
        previous = read_holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return fd, previous


def release_lock(fd, folder) -> None:
    """Remove FOLDER/.lock (if it is still ours) and drop the lock."""
    if fd is None:
        return
    path = Path(folder) / LOCK_FILE
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    os.close(fd)


# ---- common/run_record.py ----
# The run record: every read and write of a run's log folder (DEVELOPING.md, "Run record").
#
# Nothing is lost on a crash: rows are appended and fsynced one at a time, config.json is replaced
# atomically, a torn last line (a kill mid-write) is ignored when read, and nothing in the folder
# changes until every check that can refuse the run (flags, data, budget) has passed.
import json
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints.jsonl", "eval.jsonl")
# Free space a run folder needs before the first paid call: a row is small, but a full disk would stop the
# run midway, after it was paid for. A floor, not an estimate (RL's rollout trace grows with --trace-every).
RECORD_MIN_FREE = 64 * 2**20

# Our metric names -> the tinker-cookbook's, written side by side in metrics.jsonl so tools built for the
# cookbook's records (tinkerscope, dashboards) read our runs too (references/run-records.md). Only names
# that mean the same in every script: SFT's loss is the cookbook's train_mean_nll, DPO's is not, so
# tinker_sft.py writes that one itself.
COOKBOOK_METRIC_NAMES = {
    "tokens": "num_tokens", "trained_tokens": "num_loss_tokens", "eval_nll": "test/nll",
    "reward_mean": "env/all/reward/total", "kl_sample_train_v1": "optim/kl_sample_train_v1",
    "kl_sample_train_v2": "optim/kl_sample_train_v2",
}
# The cookbook renderer whose rendering a chat "format" matches (tests/test_chat_templates_oracle.py), by
# model-id prefix: (thinking off, thinking on). First match wins; a raw format is the cookbook's role_colon.
COOKBOOK_RENDERERS = (
    ("Qwen/Qwen3.5", ("qwen3_5_disable_thinking", "qwen3_5")),
    ("Qwen/Qwen3.6", ("qwen3_5_disable_thinking", "qwen3_5")),
    ("Qwen/Qwen3-", ("qwen3_disable_thinking", "qwen3")),
    ("meta-llama/Llama-3", ("llama3", "llama3")),
    ("deepseek-ai/DeepSeek-V3", ("deepseekv3", "deepseekv3_thinking")),
    ("openai/gpt-oss", ("gpt_oss_no_sysprompt", "gpt_oss_no_sysprompt")),
    ("moonshotai/Kimi-K2", ("kimi_k2", "kimi_k2")),
    ("nvidia/NVIDIA-Nemotron-3", ("nemotron3_disable_thinking", "nemotron3")),
)


class NonFiniteError(ScriptError):
    """A loss, KL or reward that is NaN or inf: what follows it would train on garbage (exit 1)."""


def non_finite(row: dict) -> dict:
    """The numeric values of a metrics row (one level of nesting, as "outer/inner") that are NaN or inf."""
    bad = {}
    for key, value in row.items():
        if isinstance(value, dict):
            bad.update({f"{key}/{k}": v for k, v in non_finite(value).items()})
        elif isinstance(value, float) and not math.isfinite(value):
            bad[key] = value
    return bad


def edited_command(sets: dict, drop=()) -> str:
    """This script's command line with each flag in `sets` given that value in place (None: a bare flag), added
    at the end when absent, and the flags in `drop` (bare flags) removed: a command to paste after a failure."""
    argv, out, i, todo = list(sys.argv), [], 1, dict(sets)
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        if flag in drop or flag in sets:
            takes_value = not eq and flag not in drop and sets.get(flag) is not None
            i += 2 if takes_value and i + 1 < len(argv) else 1
            if flag in todo:
                value = todo.pop(flag)
                out += [flag] if value is None else [flag, str(value)]
            continue
        out.append(argv[i])
        i += 1
    for flag, value in todo.items():
        out += [flag] if value is None else [flag, str(value)]
    return under_launcher(this_command([argv[0], *out]))


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# Settings a flag turns off: config.json keeps the setting (train_unembed: false), the user types the flag.
OFF_FLAGS = {"train_unembed": "--no-train-unembed"}


def resume_diff(key: str, saved, now) -> str:
    """One setting that differs on --resume, named as the user types it."""
    if key in OFF_FLAGS:
        given = {False: "given"}  # the setting is off only when the flag was given
        return f"{OFF_FLAGS[key]} {given.get(saved, 'not given')} -> {given.get(now, 'not given')}"
    return f"--{key.replace('_', '-')} {saved!r} -> {now!r}"


class Run:
    """A log folder. Checks (`resume_point`, `check_resume`) write nothing; `begin`, `append`,
    `rewind` and `checkpoint` are the only writers."""

    def __init__(self, path, extra_files=()):
        self.path = Path(path)
        self.files = RUN_FILES + tuple(extra_files)
        self._lock_fd, self._made_folders = None, []
        self.began = False  # this process started or resumed the record (begin(), or resume_point() with a row)

    def lock(self) -> Run:
        """Hold LOG/.lock until unlock() (a `with` block): one writer per run folder. Taken before anything in
        the folder is read for a decision, deleted or written; a second script on the folder (plain, --resume
        or --overwrite) stops here with exit 2 naming the holder. A lock left by a killed run is taken over."""
        check_free_space(self.path, RECORD_MIN_FREE, "the run record (--log-path)",
                         "free some space or pass a --log-path on a disk with room")
        self._made_folders = [self.path, *self.path.parents]  # those missing now, leaf first
        self._made_folders = self._made_folders[:next(i for i, d in enumerate(self._made_folders) if d.exists())]
        try:
            self._lock_fd, previous = acquire_lock(self.path)
        except FolderBusy as busy:
            alive = holder_alive(busy.holder)
            elsewhere = " (that pid is not running here: the lock is held from another machine or container)"
            how = f"wait for it to end (or stop it: kill {busy.holder['pid']})" if alive else "wait for it to end"
            raise DataError(f"{self.path} is being written by {busy}{elsewhere if alive is False else ''}; one run "
                            f"folder takes one writer at a time: {how}, then run this command again, or pass "
                            "another --log-path") from None
        if previous.get("pid"):
            say(f"note: {self.path / '.lock'} was left by {previous.get('script') or 'a script'} (pid "
                f"{previous['pid']} on host {previous.get('host')}, since {previous.get('started')}), which ended "
                "without releasing it (killed?); this run takes the folder over")
        return self

    def unlock(self) -> None:
        """Release LOG/.lock; folders this run created and left empty are removed (a refused run leaves nothing)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        release_lock(fd, self.path)
        for folder in self._made_folders:  # leaf first, each only when empty
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> Run:
        return self if self._lock_fd is not None else self.lock()

    def __exit__(self, exc_type, exc, tb) -> None:
        """Release the lock; a runtime failure of a run this process began says where the record stands and
        the command that continues it (the SDK's own errors do not)."""
        self.unlock()
        if (not isinstance(exc, Exception) or isinstance(exc, (DataError, BudgetError)) or not self.began
                or "--resume" in str(exc) or any(r.get("name") == "final" for r in self.checkpoints())):
            return
        text = f"{exc if isinstance(exc, ScriptError) else f'{type(exc).__name__}: {one_line(exc)}'}; {self.resume_hint()}"
        try:  # the same exit code (a lost service stays 4)
            failure = type(exc)(text) if isinstance(exc, ScriptError) else ScriptError(text)
        except TypeError:
            failure = ScriptError(text)
        raise failure from exc

    def resume_hint(self) -> str:
        """What to run after a failure: --resume from the last checkpoint, or the same command if there is none."""
        rows = self.checkpoints()
        if rows:
            return (f"the run record in {self.path} is saved up to its last checkpoint ({rows[-1].get('name')}, "
                    "step " f"{rows[-1].get('step')}): continue with the same command plus --resume")
        return (f"no checkpoint was saved in {self.path} yet: run the same command again with --overwrite "
                "(--resume has nothing to continue from)")

    def file(self, name) -> Path:
        return self.path / name

    def rows(self, name) -> list[dict]:
        """Rows of a JSONL file; a torn line (a kill mid-write) is skipped, a missing file is []."""
        path = self.file(name)
        if not path.exists():
            return []
        rows = []
        for _, line in jsonl_lines(path.read_text(encoding="utf-8", errors="replace")):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def append(self, name, row: dict) -> dict:
        """One row, fsynced; a torn last line left by a kill is closed first so the new row stays whole.
        A metrics row also carries the cookbook's names for the values it has (COOKBOOK_METRIC_NAMES).
        Returns the row as written."""
        bad = non_finite(row) if name == "metrics.jsonl" else {}
        if name == "metrics.jsonl":
            row = {**row, **{theirs: row[ours] for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in row}}
            if bad:  # JSON has no NaN: the row stays valid JSON and says which values were not finite
                row = {k: (None if k in bad or COOKBOOK_METRIC_NAMES.get(k) in bad else v) for k, v in row.items()}
                row.update({theirs: None for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in bad})
                row["non_finite"] = {k: repr(v) for k, v in bad.items()}
        path = self.file(name)
        with open(path, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(row) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        if bad:
            raise NonFiniteError(self.diverged_message(row, bad))
        return row

    def diverged_message(self, row: dict, bad: dict) -> str:
        """Why a run stopped on a NaN or inf metric: which values, the likely cause, where to continue from."""
        where = next((f"{k} {row[k]}" for k in ("step", "iteration") if k in row), "the last row")
        values = ", ".join(f"{k} = {v!r}" for k, v in bad.items())
        config = self.config()
        lr = config.get("learning_rate")
        # (a reward that is not finite is refused where it is returned: checked_reward, before any training)
        cause = ("the learning rate is the usual cause" + (f" (--learning-rate {lr:g} on {config.get('model_name')})"
                                                            if isinstance(lr, (int, float)) else ""))
        lower = {"--learning-rate": f"{lr / 4:g}"} if isinstance(lr, (int, float)) else {}
        # A checkpoint is sound when a finite row evaluated its weights: the row at step s+1 (SFT, DPO) or
        # iteration s (RL, distillation) was computed with the weights after s optimizer steps.
        evaluated = row["step"] - 1 if "step" in row else row.get("iteration", 0)
        ckpt = [c for c in self.checkpoints() if (c.get("step") or 0) < evaluated]
        if ckpt:
            new_log = f"{self.path}-lr{lower.get('--learning-rate', 'lower')}"
            again = edited_command({**lower, "--init-from": ckpt[-1]["state_path"], "--log-path": new_log},
                                   drop=("--resume", "--overwrite"))
            resume = (f"the last sound checkpoint is {ckpt[-1].get('name')} ({ckpt[-1]['state_path']}): continue "
                      f"from it at a lower rate in a new folder: {again} (--resume would repeat the same settings)")
        else:
            again = edited_command({**lower, "--overwrite": None}, drop=("--resume",))
            resume = f"no checkpoint was saved before it (nothing sound to --resume from): start again: {again}"
        return (f"training diverged at {where}: {values} (metrics.jsonl in {self.path}, the run stops here, "
                f"exit 1, no later checkpoint is saved); {cause}; {resume}")

    def write_json(self, name, obj) -> None:
        """Atomic replace: a kill leaves the old file or the new one, never half of one."""
        path = self.file(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def write_rows(self, name, rows) -> None:
        """Replace a JSONL file atomically (e.g. a dry run's datums.jsonl); creates the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.file(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def config(self) -> dict:
        try:
            return json.loads(self.file("config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def holds_run(self) -> bool:
        return any(self.file(n).exists() for n in ("metrics.jsonl", "checkpoints.jsonl"))

    def checkpoints(self) -> list[dict]:
        return [r for r in self.rows("checkpoints.jsonl") if r.get("state_path")]

    def resume_point(self, *, resume: bool, overwrite: bool, dry_run: bool = False) -> dict | None:
        """The checkpoint row --resume continues from (None for a new run). Refuses to mix two runs in
        one folder. Writes nothing."""
        if resume:
            rows = self.checkpoints()
            if not rows:
                raise DataError(f"--resume: no checkpoint in {self.file('checkpoints.jsonl')}; start a new run "
                                "without --resume (add --overwrite to replace what is there)")
            self.began = not dry_run
            return rows[-1]
        if self.holds_run() and not overwrite and not dry_run:
            raise DataError(f"{self.path} already holds a run; pass --resume to continue it or --overwrite to "
                            "replace it (or choose another --log-path)")
        return None

    def check_resume(self, config: dict, keys) -> None:
        """DataError naming every setting in `keys` (and the format) that differs from the saved run.
        config.json is never rewritten on resume: the saved settings stay the record of the run."""
        saved = self.config()
        if not saved:  # a folder holding only checkpoints.jsonl (copied, or written by other tools)
            say(f"warning: --resume: {self.file('config.json')} is missing or unreadable, so the settings of the "
                "saved run cannot be compared with these; continuing from its last checkpoint as asked")
            return
        diffs = [resume_diff(k, saved.get(k), config.get(k)) for k in keys if k in saved and saved.get(k) != config.get(k)]
        saved_fmt = dict(saved.get("format") or {})
        if saved_fmt.get("tokenizer"):  # runs recorded before tokenizer folders were made absolute
            saved_fmt["tokenizer"] = tokenizer_record(saved_fmt["tokenizer"])
        if saved_fmt and saved_fmt != config.get("format"):
            diffs.append("format (tokenizer, chat template or --format/--thinking)")
        trained_on, now = (saved.get("backend") or {}).get("stand_in"), backend_record()
        here = now["stand_in"]
        # unknown: a local server started without the launcher, or no service at all (a --dry-run with no key)
        known = here is not None or (now["kind"] == "tinker" and bool(os.environ.get("TINKER_API_KEY")))
        if saved.get("backend") and known and trained_on != here:  # a checkpoint of one model restored into another
            diffs.append(f"the model standing in ({trained_on or 'Tinker itself'} -> {here or 'Tinker itself'}: resume "
                         "under the launcher it trained with, `tinker_local.py run" +
                         (" --real" if (saved["backend"].get("stand_in_kind") == "real") else "") + " -- ...`)")
        if diffs:
            raise DataError(f"--resume with different settings than the saved run: {'; '.join(diffs)}; "
                            "resume with the original flags (or start a new --log-path)")

    def begin(self, config: dict) -> None:
        """A new run: the folder's old record removed, config.json written. Call after every check."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.began = True
        for name in self.files:
            self.file(name).unlink(missing_ok=True)
        self.write_json("config.json", {**config, "backend": backend_record(), **cookbook_config_fields(config)})

    def rewind(self, name, keep) -> None:
        """Keep only the rows where keep(row): rows past a resumed checkpoint will be produced again."""
        if not self.file(name).exists():
            return
        text = "".join(json.dumps(r) + "\n" for r in self.rows(name) if keep(r))
        tmp = self.file(name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.file(name))

    def checkpoint(self, *, name, step, position: dict, epoch, state_path, sampler_path, fmt, **extra) -> dict:
        """Append the checkpoints.jsonl row of a save whose paths are known; `position` is where a resume
        starts ({"next_batch": n} for SFT, {"next_iteration": n} for RL), so it neither replays nor skips."""
        row = {"name": name, "step": step, **position, "epoch": epoch, "state_path": state_path,
               "sampler_path": sampler_path, "format": fmt, "time": now_iso(), **extra,
               # the cookbook's names: `batch` is where training continues, `final` marks the last save
               "batch": next(iter(position.values())), "final": name == "final"}
        self.append("checkpoints.jsonl", row)
        return row


def cookbook_renderer_name(model_name: str, fmt: dict) -> str | None:
    """The tinker-cookbook renderer name matching how a run renders (None when no family matches)."""
    if (fmt or {}).get("kind") == "raw":
        return "role_colon"
    thinking = bool(((fmt or {}).get("template_kwargs") or {}).get("enable_thinking"))
    for prefix, names in COOKBOOK_RENDERERS:
        if model_name.startswith(prefix):
            return names[thinking]
    return None


def cookbook_config_fields(config: dict) -> dict:
    """config.json keys the cookbook's chz config has and tinkerscope reads (renderer, data file)."""
    renderer = cookbook_renderer_name(config.get("model_name", ""), config.get("format") or {})
    common = {"renderer_name": renderer, "model_name_for_tokenizer": (config.get("format") or {}).get("tokenizer")}
    if "batch_size" in config:
        common["batch_size"] = config["batch_size"]
    return {"renderer_name": renderer,
            "dataset_builder": {"common_config": common, "file_path": config.get("data")}}


# ---- common/service.py ----
# Reaching Tinker: credentials, a fast reachability check, the served-model check, checkpoint paths,
# and the optional cost preflight and per-step cost metering through tinker_pricing.py beside the script.
import os
import socket
from urllib.parse import urlsplit


HOSTED_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"  # SDK 0.38 lib/base_url.py
REACH_TIMEOUT_S = 3.0


def service_url() -> str:
    """Where the SDK will send requests: TINKER_BASE_URL, else hosted Tinker (as the SDK resolves it)."""
    return (os.environ.get("TINKER_BASE_URL") or HOSTED_BASE_URL).rstrip("/")


def check_reachable(url: str | None = None, timeout_s: float = REACH_TIMEOUT_S, setting: str = "TINKER_BASE_URL") -> None:
    """One TCP connection to the service within timeout_s, or AccessError. The SDK retries an unreachable
    first call for minutes; this turns a dead TINKER_BASE_URL into a one-line exit 4 in seconds. Once the
    service has answered, the SDK's own retries handle transient failures. setting: the flag or variable
    that chose url, named in the error."""
    import urllib.request

    url = url or service_url()
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        host, port = None, None
    if not host or parts.scheme not in ("http", "https"):
        raise AccessError(f"{setting} {url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8000"
                          + ("; unset it to use hosted Tinker" if setting == "TINKER_BASE_URL" else ""))
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(host):
        return  # through a proxy the TCP check proves nothing; the SDK reports the failure
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, socket.gaierror):
            reason = f"host {host} does not resolve"
        local = setting == "TINKER_BASE_URL" and os.environ.get("TINKER_BASE_URL")
        hint = local_hint() if local else "check the network"
        raise AccessError(f"cannot reach Tinker at {url} ({reason}, {host}:{port} within {timeout_s:g} s); "
                          f"{hint}, or fix {setting}") from None


def require_credentials(dry_run_hint: bool = True) -> str:
    """The API key (or token) the SDK will send, or AccessError; never prints its value. Imports the SDK
    (seconds on a busy machine) only when TINKER_API_KEY is unset, to look for a stored login.
    dry_run_hint: the script has --dry-run, so the error may offer it."""
    key = os.environ.get("TINKER_API_KEY", "")
    if key and not key.startswith(("tml-", "eyJ")):
        raise AccessError("TINKER_API_KEY does not start with tml-; expected a Tinker API key; copy it again "
                          "from the Tinker console")
    if key:
        return key
    import tinker

    if not tinker.auth.tinker_has_credentials():
        raise AccessError("no Tinker credentials: set TINKER_API_KEY (tml-...), "
                          + ("or check for free with --dry-run, " if dry_run_hint else "") + f"or {local_hint()}")
    return tinker.auth.get_tinker_token() or ""


def rest_client():
    """RestClient for the current environment. Explicit arguments, because RestClient() with none reuses
    the first one made in the process, whatever TINKER_BASE_URL says now."""
    import tinker

    return tinker.RestClient(base_url=os.environ.get("TINKER_BASE_URL") or None,
                             api_key=os.environ.get("TINKER_API_KEY") or None)


# ---- common/checkpoints.py ----
# Checkpoints by path and by run: tinker:// paths, the server's listing of one run, the run record's checkpoint
# rows, and an SDK failure about a checkpoint as one line with the command that shows what exists.
import os
from pathlib import Path


CHECKPOINT_SEGMENTS = ("weights", "sampler_weights", "external_weights")


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """tinker://RUN/SEGMENT/NAME -> (run, segment, name); None if not a tinker path; DataError if malformed."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_SEGMENTS or not all(parts):
        raise DataError(f"{path} is not a checkpoint path; expected tinker://RUN_ID/sampler_weights/NAME "
                        "(or weights/, external_weights/); next: " + script_command("tinker_checkpoints.py", "list"))
    return parts[0], parts[1], parts[2]


def run_checkpoints(run_id: str) -> list:
    """The server's checkpoints of one run, newest first ([] if it cannot list them: only ever a hint)."""
    try:
        # Never wait long for a hint (the SDK retries a dead server for minutes).
        require_credentials(dry_run_hint=False)
        check_reachable()
        listing = rest_client().list_checkpoints(run_id).result(timeout=20)
    except Exception:
        return []
    return sorted(listing.checkpoints, key=lambda c: c.time, reverse=True)


def tinker_failure(e: Exception, what: str, model: str | None = None) -> ScriptError:
    """An SDK exception as a one-line error with its exit code and the next step (model: the base model or
    tinker:// path the call was about, named in the message)."""
    import tinker

    message = one_line(e)
    if isinstance(e, (tinker.AuthenticationError, tinker.PermissionDeniedError)):
        return AccessError(f"{what}: Tinker rejected the API key ({message}); next: check TINKER_API_KEY")
    if isinstance(e, tinker.APIConnectionError):
        return AccessError(f"{what}: cannot reach {service_url()} ({message}); next: check the network or "
                           "TINKER_BASE_URL")
    lowered = message.lower()
    if "not loaded" in lowered:
        return ScriptError(f"{what}: the server no longer has the model behind {model} loaded ({message}); "
                           f"next: sample a sampler_weights/ checkpoint of it ({script_command('tinker_checkpoints.py', 'list')}), "
                           "or restore its last save_state path")
    if isinstance(e, tinker.NotFoundError) or "not found" in lowered or "expired" in lowered:
        run = parse_tinker_path(model)[0] if model and model.startswith("tinker://") else None
        hint = script_command("tinker_checkpoints.py", "list", *(["--run", run] if run else []))
        if os.environ.get("TINKER_LOCAL_LAUNCHER"):  # the local backend: what keeps a checkpoint there
            hint += (" (local backend: checkpoints stay in the store of its cache folder for "
                     "30 days, the oldest pruned beyond 2 GB; a server started with --run-dir sees only that "
                     "folder's; `tinker_local.py prune --all` deletes them)")
        return DataError(f"{what}: {model or 'the checkpoint'} is unknown or expired ({message}); next: {hint}")
    if isinstance(e, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        return DataError(f"{what}: the server rejected the request ({message})")
    if isinstance(e, tinker.RequestFailedError) and str(getattr(e, "category", "")).lower().endswith("user"):
        return DataError(f"{what}: the server rejected the request ({message})")
    return ScriptError(f"{what} failed: {message}")


def read_run_record(log_dir: str) -> list[dict]:
    """The rows of LOG_DIR/checkpoints.jsonl (a torn last line from a kill is skipped, as on --resume)."""
    rows_file = Path(log_dir) / "checkpoints.jsonl"
    if not rows_file.is_file():
        raise DataError(f"{rows_file} not found; expected the log folder of a tinker_sft.py/tinker_rl.py run; "
                        f"next: ls {log_dir}")
    rows = Run(log_dir).rows("checkpoints.jsonl")
    if not rows:
        raise DataError(f"{rows_file} has no checkpoint yet; let the run save one (--save-every) and retry")
    return rows


def latest_row(rows: list[dict], kind: str, where: str) -> dict:
    """The newest run-record row with a path of `kind` ("sampler": sampler_path, "state": state_path)."""
    key = "sampler_path" if kind == "sampler" else "state_path"
    for row in reversed(rows):
        if row.get(key):
            return row
    other = "state" if kind == "sampler" else "sampler"
    raise DataError(f"{where} records no {key}; it has only {other} checkpoints; next: "
                    + script_command("tinker_checkpoints.py", "resolve", where, "--kind", other))


def server_message(response) -> str:
    """The error an HTTP server put in its response body (JSON "error"/"detail", else the text), one line."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(body)[:300]
# ==== END SHARED CODE (sha256 dd278ce44c2c) ====


if __name__ == "__main__":
    exit_process(main())
