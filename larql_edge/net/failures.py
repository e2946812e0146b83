"""What counts as a member's failure, for every caller of a member (the router, the client).

A reply is one of three things:

- a success (2xx, and 304 for a conditional GET);
- the caller's own mistake (400, 413): the request is wrong, every replica would say the same, so
  it goes back to the caller unchanged and is never retried;
- the member's failure: any other status (a 404 or 405 from a member means it is not what it
  claims to be, e.g. a public URL pointing at the wrong port), a malformed or oversize reply, no
  reply in time, no connection. The member is cooled down (and evicted if it keeps failing) and
  the request is retried on another replica.

For a proxied request (the embed proxy forwards what a client sent, ids and Accept included) every
4xx is the caller's: the member's answer is passed through, only 5xx and transport failures count.
"""

from __future__ import annotations

CALLER_MISTAKES = frozenset({400, 413})


def is_success(status: int) -> bool:
    return 200 <= status < 300 or status == 304


def is_caller_mistake(status: int, proxied: bool = False) -> bool:
    if proxied:
        return 400 <= status < 500
    return status in CALLER_MISTAKES


def is_member_failure(status: int, proxied: bool = False) -> bool:
    return not is_success(status) and not is_caller_mistake(status, proxied)
