"""Object storage for job outputs and checkpoints: a local directory (the embedded default)
or S3-compatible storage through boto3. Framework-free; keys are chosen by the caller
(``<org>/<job>/…`` so nothing crosses tenants)."""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol


class Readable(Protocol):
    """Anything bytes are read from: a file, a spooled temp file, a request body."""

    def read(self, size: int = -1, /) -> bytes: ...


class StoreError(Exception):
    pass


MAX_SEGMENT = 255  # bytes, like a file name on every common file system
MAX_KEY = 1024  # S3's own limit on a key, in bytes


def bad_segment(segment: str) -> str | None:
    """Why ``segment`` may not be one part of a name or key (None when it may)."""
    if segment in ("", ".", ".."):
        return "empty, '.' or '..' part"
    if "/" in segment or "\\" in segment:
        return "path separator inside a part"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in segment):
        return "NUL or control character"
    if len(segment.encode("utf-8", "surrogatepass")) > MAX_SEGMENT:
        return f"part longer than {MAX_SEGMENT} bytes"
    return None


def check_key(key: str) -> str:
    """``key`` if it is ``<org>/<job>/<name…>`` with every part safe; ``StoreError`` otherwise.

    The one rule every store applies before touching anything, so a key can never name
    another tenant's files, whatever the caller did before.
    """
    parts = key.split("/")
    if len(parts) < 3:
        raise StoreError("a key is <org>/<job>/<name>")
    for part in parts:
        if (why := bad_segment(part)) is not None:
            raise StoreError(f"unsafe key ({why})")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY:
        raise StoreError(f"key longer than {MAX_KEY} bytes")
    return key


class Store(abc.ABC):
    @abc.abstractmethod
    def put(self, key: str, fileobj: Readable, *, size: int) -> None:
        """Store ``size`` bytes read from ``fileobj`` under ``key`` (replacing it)."""

    @abc.abstractmethod
    def open(self, key: str) -> Iterator[bytes]:
        """The object's bytes, in chunks. ``FileNotFoundError`` when absent."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Idempotent."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The stored size, or None when absent."""

    def url(self, key: str, *, expires_seconds: int, filename: str) -> str | None:
        """A short-lived download URL, when the store supports it."""
        return None


CHUNK = 1024 * 1024


class LocalStore(Store):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        # Only the control plane's user reads the store (a local job runs as another user).
        with contextlib.suppress(PermissionError):
            os.chmod(self.root, 0o700)

    def _path(self, key: str) -> Path:
        check_key(key)
        org, job, _ = key.split("/", 2)
        scope = self.root / org / job
        path = (self.root / key).resolve()  # a symlink planted in the store cannot lead out
        if scope.resolve() != scope or scope not in path.parents:
            raise StoreError("key escapes its <org>/<job>/ folder")
        return path

    def put(self, key: str, fileobj: Readable, *, size: int) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with tmp.open("wb") as out:
            shutil.copyfileobj(fileobj, out, CHUNK)
        if tmp.stat().st_size != size:
            tmp.unlink()
            raise StoreError("size mismatch while storing")
        os.replace(tmp, path)

    def open(self, key: str) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(key)

        def chunks() -> Iterator[bytes]:
            with path.open("rb") as fh:
                while block := fh.read(CHUNK):
                    yield block

        return chunks()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None


class S3Store(Store):
    """S3 or any S3-compatible service. Large objects go up as multipart uploads (boto3's
    transfer manager: parts retried individually)."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        multipart_mb: int = 16,
        presign: bool = True,
        client: Any = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.bucket, self.prefix, self.presign = bucket, prefix.strip("/"), presign
        self.client = client or boto3.client(
            "s3",
            endpoint_url=endpoint_url or None,
            region_name=region or None,
            aws_access_key_id=access_key_id or None,
            aws_secret_access_key=secret_access_key or None,
        )
        part = max(5, multipart_mb) * 1024 * 1024  # S3's minimum part size is 5 MiB
        self.transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, fileobj: Readable, *, size: int) -> None:
        self.client.upload_fileobj(fileobj, self.bucket, self._key(key), Config=self.transfer)
        if self.size(key) != size:
            raise StoreError("size mismatch while storing")

    def open(self, key: str) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            raise
        return body.iter_chunks(CHUNK)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError:
            return None

    def url(self, key: str, *, expires_seconds: int, filename: str) -> str | None:
        if not self.presign:
            return None
        return self.client.generate_presigned_url(
            "get_object",
            Params={
                "Bucket": self.bucket,
                "Key": self._key(key),
                "ResponseContentDisposition": f'attachment; filename="{filename}"',
            },
            ExpiresIn=expires_seconds,
        )
