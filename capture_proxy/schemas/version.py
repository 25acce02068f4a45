"""Format versions. Bump one when its bytes change; readers refuse what is newer than they know."""

#: The logical record (fields and their meaning). Stored on every record, covered by its digest.
#: Version 2 added the engine's weight version and spans, token-in, bridge spans, the replica, the
#: effective sampling and the logprobs mode; records of version 1 are still read and verified.
RECORD_SCHEMA_VERSION = 2
#: The digest encoding of `docs/digest.md` (domain prefix, tags, field order) for new records.
DIGEST_VERSION = 2
#: The digest encoding each record schema version is sealed and verified with: a record's
#: `schema_version` says which encoding its digest uses, so v1 records keep verifying.
DIGEST_VERSION_OF_SCHEMA = {1: 1, 2: 2}
