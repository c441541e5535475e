"""Roles, the authenticated caller (`Principal`), and the role check every operation makes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shoal.errors import PermissionDeniedError, ValidationError


class Role(StrEnum):
    """What a key may do. Each role includes the ones below it: admin ⊇ write ⊇ read."""

    READ = "read"
    WRITE = "write"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        """Position in the hierarchy; a higher rank includes every lower one."""
        return _RANKS[self]

    @classmethod
    def parse(cls, value: str | Role) -> Role:
        """The role named `value` (case-insensitive); ValidationError naming the choices otherwise."""
        try:
            return cls(value.lower() if isinstance(value, str) else value)
        except ValueError:
            choices = ", ".join(r.value for r in cls)
            raise ValidationError(f"unknown role {value!r}: must be one of {choices}") from None


_RANKS = {Role.READ: 0, Role.WRITE: 1, Role.ADMIN: 2}


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant every catalog query of the request is scoped to, and the key's role.

    `key_id` is None for the anonymous tenant (a request without an Authorization header).
    """

    tenant_name: str
    tenant_id: int
    role: Role
    key_id: str | None

    @property
    def anonymous(self) -> bool:
        """True when the caller sent no key and was admitted as the configured anonymous tenant."""
        return self.key_id is None

    def allows(self, role: str | Role) -> bool:
        """True when this principal's role includes `role`."""
        return _RANKS[self.role] >= _RANKS[role if type(role) is Role else Role.parse(role)]


def require_key(principal: Principal, what: str) -> Principal:
    """Return `principal` when it came with an API key; PermissionDeniedError saying that `what` needs one when
    the caller is anonymous (keyless callers may upload and search, never delete)."""
    if principal.anonymous:
        raise PermissionDeniedError(
            f"requests without an API key may not {what}: send 'Authorization: ApiKey <key>' with a key of "
            "your tenant"
        )
    return principal


def require(principal: Principal, role: str | Role) -> Principal:
    """Return `principal` if its role includes `role`; PermissionDeniedError otherwise."""
    needed = role if type(role) is Role else Role.parse(role)  # every request asks: no parse for a Role
    if not principal.allows(needed):
        who = "the anonymous tenant" if principal.anonymous else f"API key {principal.key_id}"
        raise PermissionDeniedError(
            f"{who} has role {principal.role.value!r}; this operation needs {needed.value!r}"
        )
    return principal
