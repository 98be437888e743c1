"""HTTP handlers of the OpenAI Files and Batches APIs (over ``OpenAIBatches``), errors in OpenAI's shape.

    POST   /v1/files                 upload (multipart: file, purpose)     -> file
    GET    /v1/files                 list (purpose, limit, order, after)   -> list of file
    GET    /v1/files/{id}            retrieve                              -> file
    GET    /v1/files/{id}/content    the file's bytes
    DELETE /v1/files/{id}            delete                                -> {id, object, deleted}
    POST   /v1/batches               create (input_file_id, endpoint, completion_window, metadata) -> batch
    GET    /v1/batches               list (limit, after), newest first     -> list of batch
    GET    /v1/batches/{id}          retrieve                              -> batch
    POST   /v1/batches/{id}/cancel   cancel                                -> batch

An upload over ``max_upload_bytes`` is a 413 naming that key (the
orchestrator's HTTP layer refuses it before buffering it; the check here
holds for any caller). Unknown ids are 404s (``No such File object``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.batches.files import FileRecord
from api.batches.openai_batches import OpenAIBatches
from api.batches.openai_schemas import (
    UPLOAD_PURPOSES,
    CreateBatchBody,
    FileDeleted,
    FileList,
    FileObject,
    OpenAIBatchList,
)
from api.batches.routes import api_endpoint, list_limit
from api.errors import InvalidRequestError, NotFoundError, RequestTooLargeError, openai_error_body

__all__ = ["openai_batch_routes", "MAX_FILE_LIST", "UPLOAD_CHUNK"]

MAX_FILE_LIST = 10_000  # OpenAI's limit on GET /v1/files?limit
MAX_BATCH_LIST = 100
UPLOAD_CHUNK = 1024 * 1024


class _Api:
    def __init__(self, batches: OpenAIBatches, max_upload_bytes: int) -> None:
        self.batches = batches
        self.files = batches.files
        self.max_upload_bytes = max_upload_bytes


def _json(payload: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def file_object(record: FileRecord) -> FileObject:
    return FileObject(id=record.id, bytes=record.bytes, created_at=int(record.created_at), filename=record.filename,
                      purpose=record.purpose)


async def _existing_file(api: _Api, request: Request) -> FileRecord:
    file_id = request.path_params["file_id"]
    record = await asyncio.to_thread(api.files.get, file_id)
    if record is None:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id")
    return record


def too_large(size: int | None, max_bytes: int) -> RequestTooLargeError:
    """The 413 of an upload over the limit (``size`` None: not known, only that it passed)."""
    seen = f"{size} bytes" if size is not None else f"over {max_bytes} bytes"
    return RequestTooLargeError(f"the upload is {seen}; this server accepts files of at most {max_bytes} bytes "
                                "(the orchestrator's max_upload_bytes)", param="file")


async def _upload(api: _Api, request: Request) -> Response:
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # noqa: BLE001 - python-multipart's and Starlette's parse errors
        raise InvalidRequestError(f"the body must be multipart/form-data with fields file and purpose: {exc}",
                                  param="file") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("file is required (a multipart file field)", param="file")
        if purpose not in {p.value for p in UPLOAD_PURPOSES}:
            allowed = ", ".join(p.value for p in UPLOAD_PURPOSES)
            raise InvalidRequestError(f"purpose must be one of {allowed}, got {purpose!r}", param="purpose")
        if upload.size is not None and upload.size > api.max_upload_bytes:
            raise too_large(upload.size, api.max_upload_bytes)
        record = await asyncio.to_thread(api.files.add, upload.filename or "upload", purpose,
                                         _chunks(upload, api.max_upload_bytes), api.batches.clock())
    finally:
        await form.close()
    return _json(file_object(record))


def _chunks(upload: UploadFile, max_bytes: int) -> Iterator[bytes]:
    seen = 0
    while chunk := upload.file.read(UPLOAD_CHUNK):
        seen += len(chunk)
        if seen > max_bytes:
            raise too_large(None, max_bytes)
        yield chunk


async def _list_files(api: _Api, request: Request) -> Response:
    limit = list_limit(request, default=MAX_FILE_LIST, most=MAX_FILE_LIST)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"order must be asc or desc, got {order!r}", param="order")
    after = request.query_params.get("after")
    page = await asyncio.to_thread(api.files.list, limit, after, request.query_params.get("purpose"),
                                   order == "desc")
    if page is None:
        raise InvalidRequestError(f"after: no file {after!r}", param="after")
    records, has_more = page
    data = [file_object(record) for record in records]
    return _json(FileList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                          last_id=data[-1].id if data else None))


async def _retrieve_file(api: _Api, request: Request) -> Response:
    return _json(file_object(await _existing_file(api, request)))


async def _file_content(api: _Api, request: Request) -> Response:
    record = await _existing_file(api, request)
    content = await asyncio.to_thread(api.files.read, record.id)
    return Response(content, media_type="application/octet-stream")


async def _delete_file(api: _Api, request: Request) -> Response:
    record = await _existing_file(api, request)
    if not await asyncio.to_thread(api.files.delete, record.id):
        raise NotFoundError(f"No such File object: {record.id}", param="file_id")
    return _json(FileDeleted(id=record.id))


async def _create_batch(api: _Api, request: Request) -> Response:
    body = msgspec.json.decode(await request.body(), type=CreateBatchBody)
    return _json(await api.batches.create(body))


async def _list_batches(api: _Api, request: Request) -> Response:
    limit = list_limit(request, most=MAX_BATCH_LIST)
    data, has_more = await api.batches.list(limit, request.query_params.get("after"))
    return _json(OpenAIBatchList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                                 last_id=data[-1].id if data else None))


async def _retrieve_batch(api: _Api, request: Request) -> Response:
    return _json(await api.batches.get(request.path_params["batch_id"]))


async def _cancel_batch(api: _Api, request: Request) -> Response:
    return _json(await api.batches.cancel(request.path_params["batch_id"]))


def openai_batch_routes(batches: OpenAIBatches, max_upload_bytes: int) -> list[Route]:
    """The Files and Batches routes over ``batches`` (the caller starts and closes it)."""
    api = _Api(batches, max_upload_bytes)
    routes = [
        ("/v1/files", _upload, "POST"),
        ("/v1/files", _list_files, "GET"),
        ("/v1/files/{file_id}", _retrieve_file, "GET"),
        ("/v1/files/{file_id}", _delete_file, "DELETE"),
        ("/v1/files/{file_id}/content", _file_content, "GET"),
        ("/v1/batches", _create_batch, "POST"),
        ("/v1/batches", _list_batches, "GET"),
        ("/v1/batches/{batch_id}", _retrieve_batch, "GET"),
        ("/v1/batches/{batch_id}/cancel", _cancel_batch, "POST"),
    ]
    return [Route(path, api_endpoint(api, handler, openai_error_body), methods=[method])
            for path, handler, method in routes]
