"""The v1 API: every app's router, mounted under /api/v1/."""

from __future__ import annotations

from rest_framework.routers import DefaultRouter

router = DefaultRouter(trailing_slash=True)

urlpatterns = router.urls
