-- Destinations managed at runtime (`pgoutbox destinations add`, the console's API): each one's
-- definition, written as a `[[destinations]]` table of the configuration file is, as JSON. Its
-- secret keys (a webhook's `secret`, `headers`, credentials in a URL) are not in `definition` but
-- sealed in `secrets` (XChaCha20-Poly1305 under the key the relays get from their environment);
-- `definition` keeps only a redacted URL to show. A few rows to a few hundred thousand, read whole
-- when a relay starts or applies a change, by page in the console.
CREATE TABLE IF NOT EXISTS {qname:definitions} (
    name       text PRIMARY KEY,
    definition jsonb NOT NULL,
    -- The sealed secrets: a version byte, the nonce, then the ciphertext of a JSON object.
    secrets    bytea,
    -- The names of the sealed keys, to show which are set without the key.
    secret_keys text[] NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
-- Every change moves this one row's version, in the change's transaction, and notifies
-- {prefix}: each relay applies the change when notified, and reads the version each second in
-- case a notification was lost (a reconnect drops them).
CREATE TABLE IF NOT EXISTS {qname:definitions_version} (
    one     boolean PRIMARY KEY DEFAULT true CHECK (one),
    version bigint NOT NULL
);
INSERT INTO {qname:definitions_version} (one, version) VALUES (true, 0) ON CONFLICT DO NOTHING;
