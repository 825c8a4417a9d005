"""(being written)"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.openapi import ADMIN_RESPONSES

router = APIRouter(
    prefix="/admin/api", tags=["admin: usage"], responses=ADMIN_RESPONSES
)
