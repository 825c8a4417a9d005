"""The admin service: what every admin call does, one module per resource.

Each function takes the gateway state, the authenticated caller where the call needs one
(logging in makes a caller rather than taking one) and the call's own arguments, and does the
whole call: who may do it, validation, the audited change (gateway/admin/audited_change.py)
and the answer's JSON model. Nothing here knows about HTTP requests: the admin API's routes
(gateway/admin/routes/) and the console's pages (gateway/console/) both call these functions,
so a rule, an audit event or an error has one home and reads the same through either door.
Blocking (database, engine): callers run them in a worker thread, as FastAPI does for sync
routes.
"""
