"""The counting hook ``benchmarks/disagg_steps.py`` installs in every process it starts (as their
``sitecustomize``): what one process did, counted, and written to ``$DISAGG_STEP_COUNT_DIR/<pid>.json``
every 0.2 s.

Counted: JSON decodes of a body holding the script's marker (``msgspec.json.decode``, every
``msgspec.json.Decoder``'s ``decode``, ``json.loads``: the client's text rides in every body that
carries the request), chat template renders, tokenizations (``Tokenizer.encode``, the prompt segment
cache's ``encode``; ``backend_encodes``: those that reached the tokenizers library), validations
(``api.prepare.check_request``), sampling-parameter builds (an API request's
``sampling_params``), detokenizers made (one per leg that detokenizes tokens) and their steps
(``backend_decodes``: the tokenizers library's decodes), and every Python call.
A profiler hook costs each call a lot: this is for counting, never for timing.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("DISAGG_STEP_COUNT_DIR")
_MARKER = os.environ.get("DISAGG_STEP_COUNT_MARKER", "").encode()

_PYTHON_STEPS = {  # (file suffix, function name) -> step
    ("api/tokenizer.py", "render_chat"): "template_renders",
    ("api/prepare.py", "check_request"): "validations",
    ("api/openai_api.py", "sampling_params"): "sampling_params_builds",
    ("api/anthropic_api.py", "sampling_params"): "sampling_params_builds",
    ("api/tokenizer.py", "encode"): "tokenizations",
    ("api/prompt_segments.py", "encode"): "tokenizations",
    ("api/detokenizer.py", "make_detokenizer"): "detokenizers",
    ("api/detokenizer.py", "add"): "detokenizer_steps",
    ("api/byte_detokenizer.py", "add"): "detokenizer_steps",
}
_C_STEPS = {"encode": "backend_encodes", "encode_batch": "backend_encodes", "encode_batch_fast": "backend_encodes",
            "decode": "backend_decodes", "id_to_token": "backend_decodes", "decode_batch": "backend_decodes"}

counts: dict[str, int] = {}
_steps_by_code: dict[object, str | None] = {}


def _count(step: str) -> None:
    counts[step] = counts.get(step, 0) + 1


def _profile(frame, event, arg):
    if event == "call":
        counts["python_calls"] = counts.get("python_calls", 0) + 1
        code = frame.f_code
        step = _steps_by_code.get(code, "")
        if step == "":
            name = code.co_filename.replace("\\", "/")
            step = next((s for (suffix, fn), s in _PYTHON_STEPS.items()
                         if fn == code.co_name and name.endswith(suffix)), None)
            _steps_by_code[code] = step
        if step is not None:
            _count(step)
    elif event == "c_call":
        owner = getattr(arg, "__self__", None)
        if owner is not None and type(owner).__module__.startswith("tokenizers"):
            step = _C_STEPS.get(arg.__name__)
            if step is not None:
                _count(step)


def _marked(data: object) -> bool:
    if isinstance(data, str):
        return _MARKER.decode() in data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _MARKER in bytes(data)
    return False


def _wrap_decoders() -> None:
    import msgspec

    plain_decode = msgspec.json.decode

    def decode(buf, *args, **kwargs):
        if _marked(buf):
            _count("body_parses")
        return plain_decode(buf, *args, **kwargs)

    real_decoder = msgspec.json.Decoder

    class Decoder:
        """A ``msgspec.json.Decoder`` whose ``decode`` counts (the C type cannot be subclassed)."""

        def __init__(self, *args, **kwargs) -> None:
            self._decoder = real_decoder(*args, **kwargs)
            self.type = self._decoder.type

        def decode(self, buf, *args, **kwargs):
            if _marked(buf):
                _count("body_parses")
            return self._decoder.decode(buf, *args, **kwargs)

        def decode_lines(self, buf):
            return self._decoder.decode_lines(buf)

    msgspec.json.decode = decode
    msgspec.json.Decoder = Decoder  # type: ignore[misc]

    plain_loads = json.loads

    def loads(s, *args, **kwargs):
        if _marked(s):
            _count("body_parses")
        return plain_loads(s, *args, **kwargs)

    json.loads = loads


def _dump_forever() -> None:
    sys.setprofile(None)  # this thread's own calls are not the process's work
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    while True:
        time.sleep(0.2)
        text = json.dumps({"argv": sys.argv, "counts": dict(counts)})
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def _start() -> None:
    counts.clear()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_dump_forever, daemon=True, name="step-count-dump").start()


if _DIR and _MARKER:
    _wrap_decoders()
    _start()
    os.register_at_fork(after_in_child=_start)
