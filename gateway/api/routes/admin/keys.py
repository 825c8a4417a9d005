"""(being written)"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.openapi import ADMIN_RESPONSES

router = APIRouter(
    prefix="/admin/api/tenants", tags=["admin: keys"], responses=ADMIN_RESPONSES
)
