"""Steps 2-10 of the porting playbook, each a typed, idempotent, transactional function.

Every public step takes one pydantic request and returns one pydantic result; it stages
its writes and applies them all at the end or none at all. ``port_model`` chains them
inside a single transaction.
"""
