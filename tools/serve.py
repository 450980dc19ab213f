"""Serve a checkpoint's generation over HTTP (JSON), with TempNet's per-token temperatures.

    torchrun --nproc-per-node 2 tools/serve.py --load checkpoints/run \
        --tensor-model-parallel-size 2 --port 5000

    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["The meaning of life is"], "tokens_to_generate": 32}'

``PUT`` or ``POST /api`` takes a JSON object:

    prompts             list of non-empty strings (required)
    tokens_to_generate  new tokens per prompt (default 64, at most --max-tokens-to-generate)
    sample              sample instead of greedy decoding (default false)
    top_k, top_p        filters for sampling (default 0 = all, 1.0)
    random_seed         sampling seed (default 1234)
    fixed_tau           one temperature for every token instead of TempNet's
    tau_max_eval        TempNet's upper bound for this request (paper's Figure 9; default: the
                        server's --tau-max-eval, or the one --tau-target-mean chose)
    stop_at_eod         stop a prompt at its end-of-document token (default true)

and answers ``{"text": [prompt + generation], "generated": [...], "tokens": [[the text each
token adds]], "token_ids": [[...]], "tau": [[the temperature each token was chosen with]],
"stopped_at_eod": [...], "tau_source": "tempnet" | "fixed"}``. ``GET /api`` describes the model.
A bad request (malformed JSON, a missing or unknown field, a value of the wrong type or range, a
prompt too long for the model) gets a 400 with ``{"error": message}``; the server keeps running.

``--tau-target-mean 0.7 --tau-target-sample FILE`` (the paper's Table 1 recipe) sets the
server's upper bound so that TempNet's mean tau over the sample's tokens is 0.7.

Requests are served one at a time (generation is batched within a request,
``--micro-batch-size`` prompts per batch). At TP > 1 rank 0 serves and the other ranks follow
it (``inference.service``). SIGINT/SIGTERM stop the server and every rank.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_tempnet.inference.cli import add_model_args, apply_tau_target, load_from_args
from megatron_tempnet.inference.generation import GenerationError, check_prompts, token_texts
from megatron_tempnet.inference.model import InferenceError
from megatron_tempnet.inference.service import Service
from megatron_tempnet.inference.token_sampling import SamplingConfig
from megatron_tempnet.losses.tau_source import FixedTau
from megatron_tempnet.utils.cli import run_tool

MAX_BODY = 1 << 20

FIELDS = {
    "prompts": list,
    "tokens_to_generate": int,
    "sample": bool,
    "top_k": int,
    "top_p": (int, float),
    "random_seed": int,
    "fixed_tau": (int, float, type(None)),
    "tau_max_eval": (int, float, type(None)),
    "stop_at_eod": bool,
}


class BadRequest(ValueError):
    """A request the server answers with 400 and ``message``."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    g.add_argument("--port", type=int, default=5000, help="0: any free port (printed)")
    g.add_argument("--micro-batch-size", type=int, default=8, help="prompts generated together")
    g.add_argument(
        "--max-tokens-to-generate", type=int, default=1024, help="the most a request may ask for"
    )
    g.add_argument("--max-prompts", type=int, default=128, help="prompts per request")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class Generator:
    """Turns a request's JSON into a collective generation and its answer (rank 0)."""

    def __init__(self, service: Service, tokenizer, args: argparse.Namespace):
        self.service, self.tokenizer, self.args = service, tokenizer, args
        self.lock = threading.Lock()

    def describe(self) -> dict:
        model = self.service.model
        return {
            "model": {
                "vocab_size": model.vocab_size,
                "max_position_embeddings": model.model.max_position_embeddings,
                "num_layers": model.model.num_layers,
                "hidden_size": model.model.hidden_size,
            },
            "tempnet": model.tempnet is not None,
            "tau_max_eval": model.tempnet.tau_max_eval if model.tempnet is not None else None,
            "tensor_model_parallel_size": self.service.size,
            "fields": sorted(FIELDS),
        }

    def request(self, body: dict) -> dict:
        r = self._validate(body)
        ids = [self.tokenizer.tokenize(p) for p in r["prompts"]]
        for i, tokens in enumerate(ids):
            if not tokens:
                raise BadRequest(f"prompts[{i}]: the tokenizer gives no tokens for it")
        try:
            check_prompts(self.service.model, ids, r["tokens_to_generate"], "tokens_to_generate")
        except GenerationError as e:
            message = str(e).replace("prompt ", "prompts[", 1).replace(":", "]:", 1)
            raise BadRequest(message) from None
        fixed = r.get("fixed_tau", self.args.fixed_tau)
        if fixed is None and self.service.model.tempnet is None:
            raise BadRequest("the model has no TempNet: give fixed_tau")
        sampling = SamplingConfig(
            greedy=not r["sample"], top_k=r["top_k"], top_p=r["top_p"], seed=r["random_seed"]
        )
        with self.lock:
            outputs = self.service.call(
                "generate",
                prompts=ids,
                max_new_tokens=r["tokens_to_generate"],
                sampling=sampling,
                tau=None if fixed is None else FixedTau(fixed),
                eod=self.tokenizer.eod if r["stop_at_eod"] else None,
                micro_batch_size=self.args.micro_batch_size,
                tau_max_eval=r.get("tau_max_eval"),
            )
        detok = self.tokenizer.detokenize
        generated = [detok(o.token_ids) for o in outputs]
        return {
            "text": [p + g for p, g in zip(r["prompts"], generated)],
            "generated": generated,
            "tokens": [token_texts(detok, o.token_ids, p) for o, p in zip(outputs, ids)],
            "token_ids": [o.token_ids for o in outputs],
            "tau": [o.tau for o in outputs],
            "stopped_at_eod": [o.stopped_at_eod for o in outputs],
            "tau_source": "fixed" if fixed is not None else "tempnet",
        }

    def _validate(self, body) -> dict:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}; expected: {', '.join(FIELDS)}")
        for name, kinds in FIELDS.items():
            value = body.get(name)
            if name in body and (
                not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _t(kinds))
            ):
                raise BadRequest(f"{name}: expected {_kind_names(kinds)}, got {json.dumps(value)}")
        if "prompts" not in body:
            raise BadRequest("missing field 'prompts' (a list of strings)")
        r = {
            "tokens_to_generate": 64,
            "sample": False,
            "top_k": 0,
            "top_p": 1.0,
            "random_seed": 1234,
            "stop_at_eod": True,
            **body,
        }
        prompts = r["prompts"]
        if not prompts or len(prompts) > self.args.max_prompts:
            raise BadRequest(f"prompts: give 1 to {self.args.max_prompts} prompts")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p:
                raise BadRequest(f"prompts[{i}]: expected a non-empty string")
        if not 1 <= r["tokens_to_generate"] <= self.args.max_tokens_to_generate:
            raise BadRequest(
                f"tokens_to_generate ({r['tokens_to_generate']}) must be in [1, "
                f"{self.args.max_tokens_to_generate}]"
            )
        if r["top_k"] < 0:
            raise BadRequest(f"top_k ({r['top_k']}) must be >= 0")
        if not 0.0 < r["top_p"] <= 1.0:
            raise BadRequest(f"top_p ({r['top_p']}) must be in (0, 1]")
        for name in ("fixed_tau", "tau_max_eval"):
            if r.get(name) is not None and not r[name] > 0:
                raise BadRequest(f"{name} ({r[name]}) must be > 0")
        return r


def _t(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds) -> str:
    names = {list: "a list", int: "an integer", float: "a number", bool: "true or false"}
    return " or ".join(names.get(k, "null") for k in _t(kinds))


def handler(generator: Generator):
    class Handler(BaseHTTPRequestHandler):
        server_version = "megatron-tempnet"

        def do_GET(self):
            if self.path.rstrip("/") != "/api":
                return self._send(HTTPStatus.NOT_FOUND, {"error": f"no endpoint {self.path}"})
            self._send(HTTPStatus.OK, generator.describe())

        def do_PUT(self):
            if self.path.rstrip("/") != "/api":
                return self._send(HTTPStatus.NOT_FOUND, {"error": f"no endpoint {self.path}"})
            try:
                body = self._body()
                self._send(HTTPStatus.OK, generator.request(body))
            except BadRequest as e:
                self._send(e.args[1] if len(e.args) > 1 else HTTPStatus.BAD_REQUEST,
                           {"error": e.args[0]})  # fmt: skip
            except InferenceError as e:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 (a failure of the server, not of the request)
                traceback.print_exc()
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR,
                           {"error": f"{type(e).__name__}: {e}"})  # fmt: skip

        do_POST = do_PUT

        def do_DELETE(self):
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "use PUT or POST /api"})

        def _body(self):
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                required = HTTPStatus.LENGTH_REQUIRED
                raise BadRequest("a Content-Length header is required", required) from None
            if length > MAX_BODY:
                raise BadRequest(f"the body is over {MAX_BODY} bytes",
                                 HTTPStatus.REQUEST_ENTITY_TOO_LARGE)  # fmt: skip
            raw = self.rfile.read(length)
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not valid JSON ({e})") from None

        def _send(self, status: HTTPStatus, payload: dict) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            sys.stderr.write(f"[serve] {self.address_string()} {fmt % args}\n")

    return Handler


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.micro_batch_size < 1:
        raise InferenceError(f"--micro-batch-size ({args.micro_batch_size}) must be >= 1")
    model, tokenizer = load_from_args(args)
    apply_tau_target(args, model, tokenizer)  # the sample: --tau-target-sample
    service = Service(model)
    if service.rank != 0:  # stopped by rank 0, which handles the signals
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        service.follow()
        return 0
    generator = Generator(service, tokenizer, args)
    try:
        server = ThreadingHTTPServer((args.host, args.port), handler(generator))
    except OSError as e:
        service.stop()
        raise InferenceError(f"--host {args.host} --port {args.port}: {e.strerror}") from None
    server.daemon_threads = True
    stop = threading.Event()

    def on_signal(signum, frame):
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host, port = server.server_address[:2]
    print(f"serving on http://{host}:{port}/api", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        with generator.lock:  # a request in flight finishes first
            service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
