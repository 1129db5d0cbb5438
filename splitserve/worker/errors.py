"""Why a worker refuses a request, as exceptions the servicers turn into gRPC statuses."""

from __future__ import annotations


class Unavailable(Exception):
    """The worker cannot take requests now (loading or draining): UNAVAILABLE."""


class PermissionDenied(Exception):
    """The caller may not ask this (a KV ticket no router vouched for): PERMISSION_DENIED."""
