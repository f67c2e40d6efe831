"""What a storage location's text says, without opening it: shared by checkpoints and streamed data."""

from __future__ import annotations

CREDENTIALS_FIX = ("remove the user:secret@ part and give them through the store's environment variables (for S3: "
                   "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), a profile or an instance role")
"""How to declare a location that :func:`carries_credentials` refused."""


def carries_credentials(location: str) -> bool:
    """Whether a URI holds a ``user:secret@`` part before its host. The run's config, and with it
    the MLflow run and the logs, would record the secret."""
    if "://" not in location:
        return False
    return "@" in location.split("://", 1)[1].split("/", 1)[0]
