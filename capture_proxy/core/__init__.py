"""The capture core: admission, rollouts, records, staging and the ledger. No HTTP here."""
