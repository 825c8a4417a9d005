"""Administration shared by the admin API and the console: who is calling (`callers`, and
`deps` for the API's routes), the audited change every mutating call makes, and the service
(`service/`) that does every call, under the API's thin routes (`routes/`)."""
