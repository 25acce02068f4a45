"""Format versions. Bump one when its bytes change; readers refuse what is newer than they know."""

#: The logical record (fields and their meaning). Stored on every record, covered by its digest.
RECORD_SCHEMA_VERSION = 1
#: The digest encoding of `docs/digest.md` (domain prefix, tags, field order).
DIGEST_VERSION = 1
