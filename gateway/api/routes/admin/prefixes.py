"""(being written)"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.openapi import ADMIN_RESPONSES

router = APIRouter(
    prefix="/admin/api/prefixes", tags=["admin: public prefixes"], responses=ADMIN_RESPONSES
)
