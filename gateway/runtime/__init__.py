"""What a running gateway keeps going beside the requests: its engine's set-up, the models it
serves, the sharing policy, tenancy changes, the audit queue, usage history and its peers.
"""
