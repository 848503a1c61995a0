"""The shared-memory extensions' bodies over REST and messages over gRPC, no transport.

System shared memory, as Triton has it: register a region of a POSIX shared-memory object by name, list
the regions, unregister one or all (`app.core.contract.regions` keeps them). CUDA shared memory is not
supported: its status lists no region, registering is refused as not supported, and unregistering (one
or all) succeeds with nothing to do, so that clients which clear both kinds first (perf_analyzer) go on.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, StrictInt, StrictStr

from app.codecs.proto import messages_pb2 as pb
from app.core.contract.errors import RegionNotFound
from app.core.contract.regions import Region


class V2RegisterSystemRegion(BaseModel):
    key: StrictStr = Field(description="The shared-memory object's name, as shm_open takes it", examples=["/input0"])
    offset: StrictInt = Field(0, description="Where the region starts in the object, in bytes")
    byte_size: StrictInt = Field(description="The region's size in bytes", examples=[65536])


class V2SystemRegionStatus(BaseModel):
    name: str = Field(examples=["input0"])
    key: str = Field(examples=["/input0"])
    offset: int
    byte_size: int = Field(examples=[65536])


def system_status(regions: list[Region]) -> list[V2SystemRegionStatus]:
    return [V2SystemRegionStatus(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size) for r in regions]


def cuda_status(name: str | None) -> list[dict[str, object]]:
    """CUDA regions: none is ever registered."""
    if name is not None:
        raise RegionNotFound(
            f"no CUDA shared-memory region named {name!r} is registered (CUDA shared memory is not supported)"
        )
    return []


def system_status_message(regions: list[Region]) -> pb.SystemSharedMemoryStatusResponse:
    Status = pb.SystemSharedMemoryStatusResponse.RegionStatus
    return pb.SystemSharedMemoryStatusResponse(
        regions={r.name: Status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size) for r in regions}
    )
