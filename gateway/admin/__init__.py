"""Administration shared by the admin API and the console: who is calling, their tokens,
login throttling, and the audited change every mutating call makes."""
