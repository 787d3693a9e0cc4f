"""TensorBoard event files, written and read with the standard library only.

An event file is a sequence of TFRecords: little-endian u64 length, masked CRC-32C of those 8 bytes,
the payload, masked CRC-32C of the payload. Each payload is an `Event` protocol buffer:
wall_time (field 1, double), step (2, int64), file_version (3, string) or summary (5, message);
a `Summary` holds repeated `value` (1) messages of tag (1, string) and simple_value (2, float).
The first record carries file_version "brain.Event:2", which TensorBoard expects.
"""
from __future__ import annotations

import struct

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _CRC32C_POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant, so CRCs of CRCs stay strong."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(payload: bytes) -> bytes:
    """Frame one TFRecord."""
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", masked_crc(length)) + payload + struct.pack("<I", masked_crc(payload))


# -- protocol buffer encoding (only the wire types the Event message needs) ------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64s are 10-byte two's complement varints
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def encode_scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """An Event holding one scalar summary value."""
    value_msg = _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value)
    summary = _bytes_field(1, value_msg)
    return _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step) + _bytes_field(5, summary)


def encode_version_event(wall_time: float) -> bytes:
    return _key(1, 1) + struct.pack("<d", wall_time) + _bytes_field(3, b"brain.Event:2")


# -- reading (for tests and tools) --------------------------------------------------------------
def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos


def _fields(buf: bytes):
    """Yield (field number, wire type, value) of a protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def read_records(data: bytes) -> list[bytes]:
    """Split a TFRecord file into payloads, checking both CRCs."""
    out, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        payload = data[pos + 12:pos + 12 + length]
        (pcrc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if hcrc != masked_crc(header) or pcrc != masked_crc(payload):
            raise ValueError(f"corrupt TFRecord at byte {pos}")
        out.append(payload)
        pos += 16 + length
    return out


def read_scalars(data: bytes) -> list[tuple[str, float, int]]:
    """Every (tag, value, step) scalar in an event file's bytes, in file order."""
    scalars = []
    for payload in read_records(data):
        step, values = 0, []
        for field, _, value in _fields(payload):
            if field == 2:
                step = value
            elif field == 5:
                for _, _, v in _fields(value):
                    parts = {f: val for f, _, val in _fields(v)}
                    values.append((parts[1].decode(), struct.unpack("<f", parts[2])[0]))
        scalars += [(tag, val, step) for tag, val in values]
    return scalars
