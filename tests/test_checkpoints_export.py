"""tinker_checkpoints.py export against a 127.0.0.1 server speaking SDK 0.38's REST routes: external-weights
signed URLs with checksums, the sampler archive route, and the refusals."""
import base64
import hashlib
import io
import json
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tinker_checkpoints

RUN = "run-7"
LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")


def safetensors_bytes(shapes):
    """A safetensors file of float32 zeros, written by hand (these tests need no torch)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + b"\x00" * offset


# The local backend's (SkyRL's) export: PEFT names, every linear layer, and "target_modules": null.
ADAPTER = safetensors_bytes({f"base_model.model.model.layers.0.{m}.lora_{ab}.weight": (8, 16)
                             for m in LINEAR for ab in "AB"})
FILES = {"adapter_config.json": b'{"r": 8, "lora_alpha": 32, "target_modules": null}',
         "adapter_model.safetensors": ADAPTER}
ALL_LINEAR = sorted(m.split(".")[1] for m in LINEAR)


def tar_bytes(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Server:
    def __init__(self):
        self.urls = dict(FILES)  # names the signing route hands out -> bytes
        self.bad_md5 = set()  # names served with a wrong Content-MD5
        self.archive = tar_bytes(FILES.items())  # None -> the archive route 404s
        self.gets = []


@pytest.fixture
def server(monkeypatch):
    state = Server()

    class Handler(BaseHTTPRequestHandler):
        def send(self, status, data, headers=()):
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def send_json(self, status, payload):
            self.send(status, json.dumps(payload).encode(), [("Content-Type", "application/json")])

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_json(200, {"use_pyqwest_transport": False} if self.path.endswith("/client/config") else {})

        def do_GET(self):
            state.gets.append(self.path)
            base = f"http://127.0.0.1:{self.server.server_address[1]}"
            if self.path.endswith("/external_weights_urls"):
                self.send_json(200, {"urls": {n: f"{base}/files/{n}" for n in state.urls},
                                     "expires": "2099-01-01T00:00:00Z"})
            elif self.path.startswith("/files/"):
                name = self.path[len("/files/"):]
                data = state.urls[name]
                md5 = hashlib.md5(b"other" if name in state.bad_md5 else data).digest()
                self.send(200, data, [("Content-MD5", base64.b64encode(md5).decode())])
            elif self.path == f"/api/v1/training_runs/{RUN}/checkpoints/final/archive":
                if state.archive is None:
                    self.send_json(404, {"detail": "Not Found"})
                else:
                    self.send(302, b"", [("Location", f"{base}/download/final.tar.gz")])
            elif self.path == "/download/final.tar.gz":
                self.send(200, state.archive)
            elif self.path == f"/api/v1/training_runs/{RUN}/checkpoints":
                self.send_json(200, {"checkpoints": [
                    {"checkpoint_id": "weights/final", "checkpoint_type": "training",
                     "time": "2026-12-01T10:00:00Z", "tinker_path": f"tinker://{RUN}/weights/final"}]})
            else:
                self.send_json(404, {"detail": "Not Found"})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("TINKER_BASE_URL", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    yield state
    httpd.shutdown()
    httpd.server_close()


def run(capsys, *argv):
    code = tinker_checkpoints.main(list(argv))
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_external_weights_are_downloaded_file_by_file_with_checksums(server, tmp_path, capsys):
    code, result = run(capsys, "export", f"tinker://{RUN}/external_weights/final",
                       "--out", str(tmp_path / "out"))
    assert code == 0, result
    assert result["route"] == "external_weights_urls"
    assert result["files"] == sorted(FILES) and result["bytes"] == sum(map(len, FILES.values()))
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == ADAPTER
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text()) == {
        "r": 8, "lora_alpha": 32, "target_modules": ALL_LINEAR}


def test_a_checksum_mismatch_fails_the_export(server, tmp_path, capsys):
    server.bad_md5.add("adapter_model.safetensors")
    code, result = run(capsys, "export", f"tinker://{RUN}/external_weights/final",
                       "--out", str(tmp_path / "out"))
    assert code == 1
    assert "md5 mismatch" in result["error"] and "adapter_model.safetensors" in result["error"]


def test_a_signed_file_name_leaving_the_folder_is_refused(server, tmp_path, capsys):
    server.urls = {"../escaped.txt": b"x"}
    code, result = run(capsys, "export", f"tinker://{RUN}/external_weights/final",
                       "--out", str(tmp_path / "out"))
    assert code == 1 and "leaves" in result["error"]
    assert not (tmp_path / "escaped.txt").exists()
    assert not any(p.name == "escaped.txt" for p in tmp_path.rglob("*"))


def test_sampler_checkpoint_comes_from_the_archive_route(server, tmp_path, capsys):
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final",
                       "--out", str(tmp_path / "out"))
    assert code == 0, result
    assert result["route"] == "archive" and result["files"] == sorted(FILES)
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == ADAPTER


def test_an_unsafe_archive_from_the_server_writes_nothing(server, tmp_path, capsys):
    server.archive = tar_bytes([("adapter_config.json", b"{}"), ("../../escaped.txt", b"x")])
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final",
                       "--out", str(tmp_path / "out"))
    assert code == 1 and "leaves the target folder" in result["error"]
    assert not (tmp_path / "out").exists()
    assert not any(p.name == "escaped.txt" for p in tmp_path.parent.rglob("escaped.txt"))


def test_without_an_archive_route_the_error_names_the_runs_weights_path(server, tmp_path, capsys):
    server.archive = None
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final",
                       "--out", str(tmp_path / "out"))
    assert code == 2
    assert f"tinker_checkpoints.py export tinker://{RUN}/weights/final --out " in result["error"]
