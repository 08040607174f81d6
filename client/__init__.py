"""Trainer-side pieces of proctor (the dataserver client and the TRL integration)."""
