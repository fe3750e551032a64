"""The client helper of the demo and the server tests: a refused request says why."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from vllm_shadowkv.server import post_json


class Refusing(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": {"message": "This model's maximum context length is 4352"}})
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_a_refused_request_carries_the_servers_reason():
    server = HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.handle_request, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1/completions"
    try:
        with pytest.raises(RuntimeError, match="HTTP 400: .*maximum context length is 4352"):
            post_json(url, {"prompt": "x" * 10})
    finally:
        server.server_close()
