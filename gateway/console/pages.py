"""How a console page is served: who is asking, what the form said, and what the browser sees.

Every console route is a `ConsoleRoute`: whatever goes wrong ends as an HTML page, never as the
admin API's JSON and never as a stack trace. No session (or one that ended) redirects to the
login page with the reason; an `APIError` (or a `TenancyError`) from the admin service
becomes an error page with its status (404 for a tenant this operator may not see, 403 for an
admin-only page); a form without a valid CSRF token is a 403 page and nothing ran; malformed
path or query parameters are a 404 or 400 page.

Pages are rendered from Jinja2 templates with autoescaping on, so every value shown (a tenant's
display name, an audit event's details) is text, never markup. Forms are posted, the change is
made by the admin service's function, and the browser is redirected (303) to a page that says
what was done, in a notice styled by its kind (done, for information, or a warning); a refused
change renders the form again with the message next to its field. What was done travels in a
one-page cookie (the flash), not in the address: the page after a save has its plain address,
and a reload of it neither says "saved" again nor sends anything. A missing value is rendered
as nothing, never as "None".
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlencode

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from jinja2 import Environment, PackageLoader, StrictUndefined
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.admin.callers import AdminCaller, caller_from_token
from gateway.console.session import (
    FLASH_COOKIE,
    SESSION_COOKIE,
    clear_flash_cookie,
    flash_cookie,
    session_csrf,
    set_flash_cookie,
    token_matches,
)
from gateway.errors import APIError, from_tenancy_error, validation_to_api_error
from gateway.http.middleware import client_ip
from gateway.state import GatewayState
from tenancy.errors import TenancyError
from tenancy.tenants import weight_text

STATIC_DIR = Path(__file__).parent / "static"
CSRF_FIELD = "csrf"
# Fields taken exactly as typed (a password may begin or end with a space); others are trimmed.
RAW_FIELDS = frozenset({"password", "current_password"})
MAX_FORM_FIELDS = 50
Model = TypeVar("Model", bound=BaseModel)


def _nothing_for_none(value: Any) -> Any:
    """What `{{ value }}` prints: a missing value is an empty string, never "None"."""
    return "" if value is None else value


_ENVIRONMENT = Environment(
    loader=PackageLoader("gateway.console", "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    finalize=_nothing_for_none,
)


@dataclass(frozen=True, slots=True)
class Notice:
    """A message at the top of a page; `kind` (its CSS class) says done, information or warning."""

    text: str
    kind: Literal["success", "info", "warning"] = "success"


# What a redirect-after-POST page says it did (its flash's `done` code): fixed texts, never
# echoed input.
NOTICES = {
    "tenant_created": Notice("Tenant created."),
    "tenant_updated": Notice("Limits and sharing saved."),
    "quota_set": Notice("Cache quota saved and applied to the engine."),
    "weight_set": Notice("Scheduling weight saved: the tenant's next request carries it."),
    "tenant_suspended": Notice("Tenant suspended: its keys stop working."),
    "tenant_resumed": Notice("Tenant resumed."),
    "tenant_deleted": Notice(
        "Tenant deleted; its cached blocks were purged, its data key destroyed."
    ),
    "key_revoked": Notice("Key revoked."),
    "prefix_added": Notice("Public prefix added."),
    "prefix_enabled": Notice("Public prefix enabled."),
    "prefix_disabled": Notice("Public prefix disabled."),
    "prefix_deleted": Notice("Public prefix deleted."),
    "operator_created": Notice("Operator created."),
    "operator_disabled": Notice("Operator disabled; their sessions ended."),
    "operator_enabled": Notice("Operator enabled."),
    "password_changed": Notice("Password changed; the account's other sessions ended."),
    "logged_out": Notice("You are logged out.", "info"),
}


class LoginRequired(Exception):
    """No usable session: the browser goes to the login page, told why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CsrfRefused(Exception):
    """A form without the session's CSRF token; nothing it asked for was done."""


@dataclass(frozen=True, slots=True)
class Form:
    """A posted form's text fields (the first value of each), its CSRF token already checked."""

    values: dict[str, str]

    def get(self, name: str, default: str = "") -> str:
        return self.values.get(name, default)

    def body(self, model: type[Model], names: Mapping[str, str] | None = None) -> Model:
        """The admin API's body `model` from the form; empty fields are left out.

        `names` maps the model's fields to the form's where they differ. Raises the API's own
        400 (`param` names the model's field) for a value the model refuses.
        """
        names = names or {}
        data: dict[str, str] = {}
        for name in model.model_fields:
            value = self.values.get(names.get(name, name), "")
            if value.strip():
                data[name] = value if name in RAW_FIELDS else value.strip()
        try:
            # Lax mode: form values are strings; the model converts "12" and "true" itself.
            return model.model_validate(data, strict=False)
        except ValidationError as error:
            raise validation_to_api_error(error.errors()) from error


@dataclass(slots=True)
class FormErrors:
    """Messages by form field; `form` holds a message that names no field on the form."""

    fields: dict[str, str] = field(default_factory=dict)
    form: str | None = None

    @classmethod
    def of(cls, error: APIError, fields: Mapping[str, str], known: set[str]) -> FormErrors:
        """Place the API's error next to the field its `param` names (through `fields`)."""
        name = fields.get(error.param or "", error.param)
        if name is not None and name in known:
            return cls({name: error.message})
        return cls(form=error.message)


def template_context(request: Request, **context: Any) -> dict[str, Any]:
    """What every page's template can use: the caller, the CSRF token, the notice.

    The notice is the page's own (`notice` in `context`) if it has one, else the fixed text of
    the `done` code in the page's flash.
    """
    caller: AdminCaller | None = getattr(request.state, "console_caller", None)
    state: GatewayState = request.app.state.gateway
    csrf = ""
    if caller is not None and caller.session_id is not None:
        csrf = session_csrf(state.settings.secret("jwt_secret"), caller.session_id)
    notice = context.pop("notice", None) or NOTICES.get(flash_of(request).get("done", ""))
    return {"caller": caller, "csrf": csrf, "notice": notice, "path": request.url.path, **context}


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    """The template rendered for this request (`title` names the page); it uses up the flash."""
    page = _ENVIRONMENT.get_template(template).render(template_context(request, **context))
    response = HTMLResponse(page, status_code=status)
    if FLASH_COOKIE in request.cookies:
        clear_flash_cookie(request, response)
    return response


class Redirect(RedirectResponse):
    """A 303 to `url`; `flash` (what was done) goes to that page in a cookie, by `ConsoleRoute`."""

    def __init__(self, url: str, flash: dict[str, str]) -> None:
        super().__init__(url, status_code=303)
        self.flash = flash


def redirect(
    url: str, done: str | None = None, details: Mapping[str, str] | None = None, **query: str
) -> Redirect:
    """Redirect (303) to `url` with `query` in its address, and after a POST say what was done.

    `done` (a `NOTICES` code) and its `details` (say, the units the form was in) are the
    flash: for the page at `url` only, shown once, never in the address.
    """
    target = f"{url}?{urlencode(query)}" if query else url
    flash = {"page": url, "done": done, **(details or {})} if done else {}
    return Redirect(target, flash)


def flash_of(request: Request) -> dict[str, str]:
    """The flash the redirect to this page carried (empty if none, or if meant for another)."""
    state: GatewayState = request.app.state.gateway
    flash = flash_cookie(request, state.settings.secret("jwt_secret"))
    return flash if flash.get("page") == request.url.path else {}


def error_page(request: Request, status: int, message: str) -> HTMLResponse:
    titles = {400: "Bad request", 403: "Not allowed", 404: "Not found", 409: "Conflict"}
    title = titles.get(status, "Something went wrong")
    return render(request, "error.html", status, title=title, code=status, message=message)


def get_console_caller(request: Request) -> AdminCaller:
    """The operator behind the session cookie (sync: FastAPI runs it in a worker thread)."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        raise LoginRequired("login")
    state: GatewayState = request.app.state.gateway
    try:
        caller = caller_from_token(state, token, client_ip(request.scope))
    except APIError as error:
        raise LoginRequired("expired") from error
    request.state.console_caller = caller
    return caller


CallerDep = Annotated[AdminCaller, Depends(get_console_caller)]


async def read_form(request: Request) -> dict[str, str]:
    """The posted form's text fields (file parts and repeated names beyond the first ignored)."""
    form = await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
    values: dict[str, str] = {}
    for name, value in form.multi_items():
        if isinstance(value, str) and name not in values:
            values[name] = value
    return values


def checked_form(
    request: Request, caller: CallerDep, values: Annotated[dict[str, str], Depends(read_form)]
) -> Form:
    """The form, if it carries this session's CSRF token; else CsrfRefused before any change."""
    state: GatewayState = request.app.state.gateway
    expected = session_csrf(state.settings.secret("jwt_secret"), caller.session_id or "")
    if caller.session_id is None or not token_matches(expected, values.get(CSRF_FIELD)):
        raise CsrfRefused
    return Form(values)


FormDep = Annotated[Form, Depends(checked_form)]


class ConsoleRoute(APIRoute):
    """A console route: its failures become HTML pages or a redirect to the login page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response = await handler(request)
                if isinstance(response, Redirect) and response.flash:
                    state: GatewayState = request.app.state.gateway
                    secret = state.settings.secret("jwt_secret")
                    set_flash_cookie(request, response, secret, response.flash)
                return response
            except LoginRequired as refused:
                return redirect("/admin/login", reason=refused.reason)
            except CsrfRefused:
                message = "This form has expired or did not come from this console; nothing "
                message += "was changed. Reload the page and try again."
                return error_page(request, 403, message)
            except APIError as error:
                return error_page(request, error.status, error.message)
            except TenancyError as error:  # raised outside `apply_change` (a lookup by id)
                api_error = from_tenancy_error(error)
                return error_page(request, api_error.status, api_error.message)
            except RequestValidationError as error:
                in_path = any(problem.get("loc", ("",))[0] == "path" for problem in error.errors())
                if in_path:
                    return error_page(request, 404, "There is no such page.")
                return error_page(request, 400, validation_to_api_error(error.errors()).message)
            except HTTPException as error:
                return error_page(request, error.status_code, str(error.detail))

        return guarded


def format_bytes(count: int) -> str:
    """Bytes as a person reads them: 1.5 GiB, 512 MiB, 900 B."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_time(moment: datetime | None) -> str:
    return "—" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def format_hit_ratio(ratio: float, prompt_tokens: int) -> str:
    """A hit ratio as a percentage, or "—" when there were no prompt tokens to hit."""
    return "—" if prompt_tokens <= 0 else f"{100 * ratio:.1f}%"


_ENVIRONMENT.filters["bytes"] = format_bytes
_ENVIRONMENT.filters["when"] = format_time
_ENVIRONMENT.filters["percent"] = lambda ratio: f"{100 * ratio:.1f}%"
_ENVIRONMENT.filters["hit_ratio"] = format_hit_ratio
_ENVIRONMENT.filters["thousands"] = lambda number: f"{number:,}"
_ENVIRONMENT.filters["weight"] = weight_text
