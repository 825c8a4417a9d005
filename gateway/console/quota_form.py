"""The quota form of a tenant's page: its amounts as the admin API's quota body, and back.

The pool's quota and reservation are given in blocks or tokens (tokens are rounded up to whole
blocks); an empty one stays as it is. The second KV tier's quota and reservation are given in
bytes, KiB, MiB, GiB or TiB (rounded up to whole bytes; decimals allowed, so 1.5 GiB is a
size); an empty one is the default (the quota: the pool quota's bytes; the reservation: none),
and a form without the field leaves it as it is. A saved size comes back in the unit it was
saved in when that unit holds it whole, else in the largest unit that does.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation

from pydantic import ValidationError

from gateway.admin.schemas import QuotaUpdate
from gateway.console.pages import Form
from gateway.errors import APIError, validation_to_api_error
from tenancy.tenants import MAX_TIER_BYTES

TIER_AMOUNTS = ("tier_quota", "tier_reservation")
QUOTA_FIELDS = {
    "quota",
    "quota_unit",
    "reservation",
    "reservation_unit",
    *TIER_AMOUNTS,
    *(f"{what}_unit" for what in TIER_AMOUNTS),
}
# The admin API's names for the quota form's amounts (the API's `param`s).
QUOTA_PARAMS = {
    "quota_blocks": "quota",
    "quota_tokens": "quota",
    "cache_quota_blocks": "quota",
    "reservation_blocks": "reservation",
    "reservation_tokens": "reservation",
    "cache_reservation_blocks": "reservation",
    "tier_quota_bytes": "tier_quota",
    "tier_reservation_bytes": "tier_reservation",
}
UNITS = ("blocks", "tokens")
# The tier amounts' units, by the bytes each stands for; largest first.
BYTE_UNITS = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}
DEFAULT_BYTE_UNIT = "MiB"


def quota_body(form: Form) -> QuotaUpdate:
    """The API's quota body from the form's amounts and their units: the pool's in blocks or
    tokens (an empty one stays), the tier's in bytes to TiB (an empty one is the default; one
    the form does not have stays)."""
    data: dict[str, object] = {}
    for what in ("quota", "reservation"):
        amount = form.get(what).strip()
        if not amount:
            continue
        unit = form.get(f"{what}_unit", "blocks")
        if unit not in UNITS:
            raise APIError.invalid(f"{what} unit must be blocks or tokens", what)
        data[f"{what}_{unit}"] = amount
    for what in TIER_AMOUNTS:
        if what in form.values:
            data[f"{what}_bytes"] = tier_bytes(form, what)
    try:
        # Lax mode, as `Form.body`: the pool's amounts are the form's strings.
        return QuotaUpdate.model_validate(data, strict=False)
    except ValidationError as error:
        raise validation_to_api_error(error.errors()) from error


def tier_bytes(form: Form, what: str) -> int | None:
    """A tier amount of the form in whole bytes (rounded up), None when empty (the default)."""
    amount = form.get(what).strip()
    if not amount:
        return None
    label = what.replace("_", " ")
    unit = form.get(f"{what}_unit", DEFAULT_BYTE_UNIT)
    if unit not in BYTE_UNITS:
        raise APIError.invalid(
            f"{label} unit must be one of {', '.join(BYTE_UNITS)}", f"{what}_bytes"
        )
    try:
        number = Decimal(amount)
    except InvalidOperation:
        number = Decimal("NaN")
    if not number.is_finite():
        raise APIError.invalid(f"{label}: expected a number of {unit}", f"{what}_bytes")
    # Bounded before it is multiplied out: 1e999999 would be a number of a million digits.
    if abs(number) > MAX_TIER_BYTES:
        raise APIError.invalid(f"{label}: at most {MAX_TIER_BYTES} bytes", f"{what}_bytes")
    return math.ceil(number * BYTE_UNITS[unit])


def tier_amount(value: int | None, asked: str | None) -> tuple[str, str]:
    """A tier size as the form shows it: (amount, unit), in the unit it was saved in when that
    holds it whole, else the largest that does; empty (the default) for None."""
    if value is None:
        return "", asked if asked in BYTE_UNITS else DEFAULT_BYTE_UNIT
    units = [asked] if asked in BYTE_UNITS else []
    unit = next(u for u in (*units, *BYTE_UNITS) if value % BYTE_UNITS[u] == 0)
    return str(value // BYTE_UNITS[unit]), unit


def pool_unit(asked: str | None) -> str:
    """The unit a save was made in (the page's flash: tokens), else blocks."""
    return asked if asked in UNITS else "blocks"


def saved_units(form: Form) -> dict[str, str]:
    """The units a saved form used where they are not the defaults, for the next page."""
    units = {
        name: form.get(name)
        for name in ("quota_unit", "reservation_unit")
        if form.get(name) in UNITS and form.get(name) != "blocks"
    }
    units |= {
        f"{what}_unit": form.get(f"{what}_unit")
        for what in TIER_AMOUNTS
        if form.get(f"{what}_unit") in BYTE_UNITS
    }
    return units
