"""The HDF5 trajectory spool: rollouts publish prompt groups, the trainer claims them.

``format`` defines one file (``TrajectoryGroup`` <-> HDF5, validated on read;
``h5io`` is its low-level HDF5 access, ``schema1`` reads the previous layout);
``store`` defines the directory life cycle (publish -> ready -> claimed ->
trained | dropped | quarantine); ``taken`` is the trainer's mark of the batch in
hand, which rollouts read so as not to publish what it leaves stale. See
docs/spool-format.md.
"""

from hpcrl.spool.format import (
    SCHEMA_VERSION,
    NameInfo,
    Sample,
    SpoolFormatError,
    TrajectoryGroup,
    encode_group,
    encode_group_read,
    file_name,
    parse_name,
    read_group,
    validate_group,
    write_group,
)
from hpcrl.spool.store import Spool, SpoolEntry

__all__ = [
    "SCHEMA_VERSION",
    "NameInfo",
    "Sample",
    "Spool",
    "SpoolEntry",
    "SpoolFormatError",
    "TrajectoryGroup",
    "encode_group",
    "encode_group_read",
    "file_name",
    "parse_name",
    "read_group",
    "validate_group",
    "write_group",
]
