"""What the orchestrator and a worker's frontends say to each other over HTTP: one typed module.

The legs of a disaggregated request are the API's own requests (``/v1/completions``,
``/v1/chat/completions``, ``/v1/messages``) with a few fields the orchestrator sets; it never
re-encodes what it does not read. So each leg is the client's body plus one of these structs:

- ``CtxLegFields``: the ``context_only`` leg's one token, no streaming, the params with the
  orchestrator's prompt ids (every API: the ctx worker neither renders nor tokenizes the body
  again); the client's ``stream``, ``stream_options``, ``max_tokens``, ``max_completion_tokens``
  are dropped first (``CTX_DROPPED``).
- ``CtxAnswer``: what the orchestrator reads of the ctx answer (its ``disaggregated_params``, and
  ``prompt_token_ids`` only when the leg was sent none: the ids are not echoed back); the rest of the answer stays bytes, shown to the client as they came
  when the request ended on its first token (``client_answer``).
- ``GenLegFields``: the ``generation_only`` (or ``resume``) leg: the client's own bytes with the
  params appended (``with_fields``): the client's body is never decoded and re-encoded for it.
- ``PrefixExportLeg``: the KV pool's export leg (``orchestrator.kv_pool``), a whole body.
- ``WorkerInfo``: ``GET /worker_info``.
- ``KVEventEntry``: one entry of ``GET /kv_cache_events`` as the orchestrator reads it (the
  engine writes ``workers.engine.kv_events.KVEvent``; short type names are accepted too).

And the kinds both sides name: ``Role`` (a worker's), ``Phase`` (a leg's), ``Mode`` (how a
request was served: the ``x-disagg-mode`` header), ``RequestType`` (``workers.disagg_params``).
Torch-free: the orchestrator imports it.
"""

from __future__ import annotations

import enum

import msgspec

from workers.disagg_params import DisaggParams, RequestType

__all__ = [
    "CTX_DROPPED",
    "CtxAnswer",
    "CtxLegFields",
    "GenLegFields",
    "KVEventEntry",
    "KVEventRecord",
    "KVEventsPage",
    "Mode",
    "Phase",
    "PrefixExportLeg",
    "RequestType",
    "Role",
    "WorkerInfo",
    "client_answer",
    "decode_kv_events",
    "with_fields",
]


class Role(enum.StrEnum):
    """What legs a worker serves (its ``--role``)."""

    BOTH = "both"
    CTX = "ctx"
    GEN = "gen"


class Phase(enum.StrEnum):
    """A leg of a disaggregated request: the prefill (ctx) or the decode (gen)."""

    CTX = "ctx"
    GEN = "gen"


class Mode(enum.StrEnum):
    """How the orchestrator served a request (the ``x-disagg-mode`` header, request logs, metrics)."""

    AGGREGATED = "aggregated"  # one normal request to the gen worker
    DISAGG = "disagg"  # a ctx leg, then a gen leg
    CTX_ONLY = "ctx_only"  # the ctx leg's first token ended the request: its answer is the client's


# The client's fields a ctx leg does not send: it sets its own (one token, no stream).
CTX_DROPPED = frozenset({"stream", "stream_options", "max_tokens", "max_completion_tokens"})


class CtxLegFields(msgspec.Struct, frozen=True):
    """The fields the orchestrator sets on a ``context_only`` leg (``CTX_DROPPED`` dropped first)."""

    disaggregated_params: DisaggParams
    max_tokens: int = 1
    stream: bool = False


class GenLegFields(msgspec.Struct, frozen=True):
    """The field the orchestrator adds to the client's body for a ``generation_only`` or ``resume`` leg."""

    disaggregated_params: DisaggParams


class CtxAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the orchestrator reads of a ctx answer (an export's too); a worker that serves no legs
    answers without them (None)."""

    disaggregated_params: DisaggParams | None = None
    prompt_token_ids: list[int] | None = None

    def gen_params(self, sent_prompt_ids: list[int] | None = None) -> DisaggParams | None:
        """The ``generation_only`` params built on these, or None when they cannot make one (no
        params or prompt ids; the first token finished the request). ``sent_prompt_ids``: the ids the
        ctx leg was sent, which its answer does not echo (the signature covers them: a gen worker
        refuses params whose ids are not the ones the ctx worker prefilled)."""
        params = self.disaggregated_params
        prompt = self.prompt_token_ids if self.prompt_token_ids is not None else sent_prompt_ids
        if params is None or prompt is None or params.finished:
            return None
        return msgspec.structs.replace(params, request_type=RequestType.GENERATION_ONLY, prompt_token_ids=prompt)


class PrefixExportLeg(msgspec.Struct, frozen=True):
    """The KV pool's export leg: park a prompt prefix's KV on the worker that holds it."""

    model: str | None
    prompt: list[int]
    disaggregated_params: DisaggParams
    max_tokens: int = 1
    ignore_eos: bool = True  # the one token sampled there must not end the leg: its KV would not park
    stream: bool = False


class WorkerInfo(msgspec.Struct, frozen=True):
    """``GET /worker_info``: what an orchestrator needs to route to a worker (``frontends.worker_info``).
    None: not known (a worker that does not say; the orchestrator's defaults apply)."""

    role: Role = Role.BOTH
    model: str | None = None
    kv_endpoint: str | None = None
    block_size: int | None = None
    hash_seed: int | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None  # the orchestrator validates token ids against it
    server_time: float | None = None  # the orchestrator measures this worker's clock offset from it


class KVEventRecord(msgspec.Struct, frozen=True):
    """What the orchestrator's KV index reads of one KV-cache event (``workers.engine.kv_events``)."""

    type: str  # BlockStored | BlockRemoved | AllBlocksCleared, or stored | removed | cleared
    block_hashes: list[int] = msgspec.field(default_factory=list)
    tier: str = "pool"


class KVEventEntry(msgspec.Struct, frozen=True):
    """One entry of ``GET /kv_cache_events``: an event and its place in the worker's event stream."""

    event: KVEventRecord
    event_id: int | None = None
    timestamp: float | None = None


class KVEventsPage(msgspec.Struct, frozen=True):
    """The page as an object (``{"events": [...]}``), accepted beside the plain list our workers write."""

    events: list[KVEventEntry] = msgspec.field(default_factory=list)


_KV_EVENTS = msgspec.json.Decoder(list[KVEventEntry] | KVEventsPage)
_CTX_ANSWER_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def decode_kv_events(content: bytes) -> list[KVEventEntry]:
    """A ``/kv_cache_events`` page; raises msgspec.DecodeError (ValidationError) for one that is not."""
    page = _KV_EVENTS.decode(content)
    return page.events if isinstance(page, KVEventsPage) else page


def client_answer(content: bytes) -> bytes:
    """A ctx answer shown to the client as is (the request finished on its first token): every
    field but the two the orchestrator reads, their values as they came."""
    fields = _CTX_ANSWER_FIELDS.decode(content)
    return msgspec.json.encode({k: v for k, v in fields.items() if k not in CtxAnswer.__struct_fields__})


def with_fields(body: bytes, fields: msgspec.Struct) -> bytes:
    """A JSON object's bytes with ``fields``' own added at its end. The object must not hold any of
    their names already (the caller dropped them, or the client may not send them)."""
    added = msgspec.json.encode(fields)
    if added == b"{}":
        return body
    head = body.rstrip()
    if not head.endswith(b"}"):
        raise ValueError("the body is not a JSON object")
    head = head[:-1].rstrip()
    return head + (b"" if head.endswith(b"{") else b",") + added[1:]
