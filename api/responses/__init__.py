"""The OpenAI Responses API (``/v1/responses``), run as a chat request.

Workers serve it through their chat handler (``api``); the orchestrator
through its disaggregated chat flow (``orchestrator.responses``). Both
render with ``render`` and keep stored responses in a ``store.ResponseStore``:
the launcher's on a worker, a shared file in the orchestrator's state
directory. Wire a worker app as::

    store = LocalResponses(ResponseStore(state_dir / RESPONSES_FILE))   # the launcher
    build_app(..., responses=store, prefix_routes=[*admin_routes(store), ...])
    build_app(..., responses=LauncherResponses(admin_socket_path))     # an attached frontend
"""

from api.responses.api import (
           admin_routes,
           begin_turn,
           create_response,
           delete_response,
           list_input_items,
           retrieve_response,
           store_turn,
)
from api.responses.items import input_items_page
from api.responses.render import ResponseEventStream, ResponseTurn
from api.responses.store import RESPONSES_FILE, LauncherResponses, LocalResponses, ResponsesClient, ResponseStore

__all__ = ["admin_routes", "begin_turn", "store_turn", "create_response", "retrieve_response", "delete_response",
           "list_input_items", "input_items_page",
           "ResponseEventStream", "ResponseTurn", "LauncherResponses", "LocalResponses", "ResponsesClient",
           "ResponseStore", "RESPONSES_FILE"]
