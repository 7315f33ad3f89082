//! The outbox table's name, and the statements an application runs against it (enqueue).
//!
//! Schema and table names come from configuration, so they are validated as plain identifiers and
//! quoted once, here, when an [`OutboxTable`] is built; statements are rendered from templates with
//! [`OutboxTable::render`] (the relay's own live in its store).

use std::fmt;

use crate::error::{Error, Result};

/// Longest accepted identifier: PostgreSQL's limit is 63 bytes and index names add a suffix.
pub const MAX_IDENT_LEN: usize = 40;

/// A validated SQL identifier (schema or table name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident(String);

impl Ident {
    /// Validates `name` as `[A-Za-z_][A-Za-z0-9_]*` of at most [`MAX_IDENT_LEN`] characters.
    pub fn parse(name: &str) -> Result<Self> {
        let mut chars = name.chars();
        let first_ok = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if first_ok && rest_ok && name.len() <= MAX_IDENT_LEN {
            Ok(Self(name.to_owned()))
        } else {
            Err(Error::InvalidIdentifier(name.to_owned()))
        }
    }

    /// The bare name, as stored in the catalogs.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted for SQL (validation guarantees there is no quote inside).
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An outbox table (schema + name) and its statements, rendered once.
#[derive(Clone)]
pub struct OutboxTable {
    schema: Ident,
    table: Ident,
    /// Named statements, see [`Queries`].
    pub sql: Queries,
}

impl OutboxTable {
    /// The default table, `public.outbox`.
    pub fn default_table() -> Self {
        Self::new(Ident("public".into()), Ident("outbox".into()))
    }

    /// Builds the table handle from raw names, validating both.
    pub fn parse(schema: &str, table: &str) -> Result<Self> {
        Ok(Self::new(Ident::parse(schema)?, Ident::parse(table)?))
    }

    /// Builds the table handle from validated names.
    pub fn new(schema: Ident, table: Ident) -> Self {
        let sql = Queries::render(&schema, &table);
        Self { schema, table, sql }
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The table name.
    pub fn table(&self) -> &Ident {
        &self.table
    }

    /// `"schema"."table"`, ready for SQL.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.table.quoted())
    }

    /// The prefix of this table's logical decoding messages (`<table>_emit()`): a relay reading
    /// the WAL takes only messages with its own table's prefix.
    pub fn message_prefix(&self) -> String {
        self.render("{prefix}")
    }

    /// An object name derived from the table's (index, function), quoted and schema-qualified.
    pub fn derived(&self, suffix: &str) -> String {
        format!(
            "{}.\"{}_{}\"",
            self.schema.quoted(),
            self.table.as_str(),
            suffix
        )
    }

    /// An unqualified derived name (for `CREATE INDEX name`), quoted.
    pub fn derived_bare(&self, suffix: &str) -> String {
        format!("\"{}_{}\"", self.table.as_str(), suffix)
    }

    /// Replaces `{outbox}`, `{schema}`, `{name}` and `{name:SUFFIX}` placeholders in a template.
    pub fn render(&self, template: &str) -> String {
        render(template, &self.schema, &self.table)
    }
}

impl fmt::Debug for OutboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OutboxTable({self})")
    }
}

impl fmt::Display for OutboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

fn render(template: &str, schema: &Ident, table: &Ident) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start..].find('}') else {
            break;
        };
        let placeholder = &rest[start + 1..start + len];
        let replacement = match placeholder {
            "outbox" => Some(format!("{}.{}", schema.quoted(), table.quoted())),
            "schema" => Some(schema.quoted()),
            "table" => Some(table.quoted()),
            // The logical decoding message prefix of `{name}_emit` (see `message_prefix`).
            "prefix" => Some(format!("pgoutbox:{}.{}", schema.as_str(), table.as_str())),
            p if p.starts_with("name:") => Some(format!("\"{}_{}\"", table.as_str(), &p[5..])),
            p if p.starts_with("qname:") => Some(format!(
                "{}.\"{}_{}\"",
                schema.quoted(),
                table.as_str(),
                &p[6..]
            )),
            _ => None,
        };
        out.push_str(&rest[..start]);
        match replacement {
            Some(r) => out.push_str(&r),
            // Not a placeholder (a JSON literal such as '{}'): keep it as written.
            None => out.push_str(&rest[start..start + len + 1]),
        }
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    out
}

/// The statements an application runs against the outbox table (enqueue), rendered for one table.
/// The relay's own statements live in the relay crate's store.
#[derive(Clone, Debug)]
pub struct Queries {
    /// `OutboxInsert`: one event.
    pub insert_one: String,
    /// `OutboxInsertMany`: many events in one statement.
    pub insert_many: String,
}

impl Queries {
    fn render(schema: &Ident, table: &Ident) -> Self {
        Self {
            insert_one: render(INSERT_ONE, schema, table),
            insert_many: render(INSERT_MANY, schema, table),
        }
    }
}

/// OutboxInsert. The id is made by the adapter (a UUIDv7, `enqueue::new_id`); every other column
/// not named has a default, as for any plain-SQL producer.
const INSERT_ONE: &str = "
INSERT INTO {outbox} (id, topic, payload, key, headers)
VALUES ($5, $1, $2::text::jsonb, $3, $4::text::jsonb)
RETURNING id";

/// OutboxInsertMany. One round trip for a whole batch; unnest keeps the array order, and so `seq`.
const INSERT_MANY: &str = "
INSERT INTO {outbox} (id, topic, payload, key, headers)
SELECT i, t, p::jsonb, k, h::jsonb
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::uuid[])
     WITH ORDINALITY AS e(t, p, k, h, i, n)
ORDER BY n
RETURNING id";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(Ident::parse("outbox").is_ok());
        assert!(Ident::parse("_events_2").is_ok());
        for bad in [
            "",
            "x; drop table y",
            "1abc",
            "a\"b",
            "a.b",
            "ünïcode",
            &"a".repeat(41),
        ] {
            assert!(Ident::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn templates_render_quoted_names_and_keep_json_literals() {
        let t = OutboxTable::parse("app", "events").expect("valid");
        assert_eq!(
            t.render("CREATE INDEX {name:pending_idx} ON {outbox} DEFAULT '{}'"),
            "CREATE INDEX \"events_pending_idx\" ON \"app\".\"events\" DEFAULT '{}'"
        );
        assert!(t.sql.insert_one.contains("INTO \"app\".\"events\""));
    }
}
