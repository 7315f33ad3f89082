//! A sink's settings table read as two structs: the keys only that sink takes, and the keys it
//! shares with the sinks of its kind (every AWS sink's region and endpoint, every broker sink's
//! `tls` and `body`), so that the shared keys are declared, documented and checked once.
//!
//! serde's `#[serde(flatten)]` reads such a table, but not together with `deny_unknown_fields`:
//! a key that no part takes is then reported only after every other check (a misspelt required
//! key reads as that key missing) and without the list of the keys the table may hold. [`Flat`]
//! reads the table as one struct holding every key would: the first key, in the table's order,
//! that no part takes or whose value is wrong is the error, in serde's words (``unknown field `x`,
//! expected one of …``), and a missing key is reported only when no key is wrong.

use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// A sink's settings: the keys of `Own` and of `Common`, side by side in one table.
///
/// Both parts derive `Deserialize` as plain structs (no `flatten`: serde hands their key names to
/// `deserialize_struct`, which is how [`Flat`] learns them) and take no key in common.
#[derive(Debug, Clone)]
pub struct Flat<Own, Common> {
    /// The keys only this sink takes.
    pub own: Own,
    /// The keys it shares with the sinks of its kind.
    pub common: Common,
}

impl<'de, Own: DeserializeOwned, Common: DeserializeOwned> Deserialize<'de> for Flat<Own, Common> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let table = toml::Table::deserialize(d)?;
        read(table).map_err(de::Error::custom)
    }
}

/// Where reading a part went wrong: serde's message, and the position in the table of the key
/// it is about (none when a key is missing: that is found only after every key was read).
#[derive(Clone)]
struct Failure {
    at: Option<usize>,
    message: String,
}

/// Reads `table` as `Own` and `Common`; the error is the one a struct of both parts' keys, `Own`'s
/// first, would have given.
fn read<Own, Common>(table: toml::Table) -> Result<Flat<Own, Common>, String>
where
    Own: DeserializeOwned,
    Common: DeserializeOwned,
{
    let (own_keys, common_keys) = (keys::<Own>(), keys::<Common>());
    let (mut own, mut common, mut unknown) = (Vec::new(), Vec::new(), None);
    for (at, (key, value)) in table.into_iter().enumerate() {
        if own_keys.contains(&key.as_str()) {
            own.push((at, key, value));
        } else if common_keys.contains(&key.as_str()) {
            common.push((at, key, value));
        } else if unknown.is_none() {
            unknown = Some(Failure {
                at: Some(at),
                message: unknown_field(&key, &[own_keys, common_keys].concat()),
            });
        }
    }
    let (own, common) = (part::<Own>(own), part::<Common>(common));
    let failures = [
        unknown,
        own.as_ref().err().cloned(),
        common.as_ref().err().cloned(),
    ];
    // One struct stops at its first wrong key, and looks for missing keys only after the last.
    let first = failures
        .into_iter()
        .flatten()
        .min_by_key(|f| f.at.unwrap_or(usize::MAX));
    match (first, own, common) {
        (None, Ok(own), Ok(common)) => Ok(Flat { own, common }),
        (Some(failure), _, _) | (None, Err(failure), _) | (None, _, Err(failure)) => {
            Err(failure.message)
        }
    }
}

/// `T` read from its entries, each with its position in the whole table.
fn part<T: DeserializeOwned>(entries: Vec<(usize, String, toml::Value)>) -> Result<T, Failure> {
    let mut failed_at = None;
    let read = T::deserialize(Entries {
        entries: entries.into_iter(),
        value: None,
        failed_at: &mut failed_at,
    });
    read.map_err(|e| Failure {
        at: failed_at,
        message: e.message().to_owned(),
    })
}

/// serde's message for a key no struct field takes, listing `expected`.
fn unknown_field(key: &str, expected: &[&str]) -> String {
    let names: Vec<String> = expected.iter().map(|k| format!("`{k}`")).collect();
    match names.as_slice() {
        [] => format!("unknown field `{key}`, there are no fields"),
        [one] => format!("unknown field `{key}`, expected {one}"),
        [a, b] => format!("unknown field `{key}`, expected {a} or {b}"),
        all => format!("unknown field `{key}`, expected one of {}", all.join(", ")),
    }
}

/// One part's entries, handed over as toml hands a table's (the same values, so the same
/// messages), noting the position of the key whose value could not be read.
struct Entries<'a> {
    entries: std::vec::IntoIter<(usize, String, toml::Value)>,
    value: Option<(usize, toml::Value)>,
    failed_at: &'a mut Option<usize>,
}

impl<'de> Deserializer<'de> for Entries<'_> {
    type Error = toml::de::Error;

    fn deserialize_any<V: Visitor<'de>>(mut self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_map(&mut self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = toml::de::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some((at, key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some((at, value));
        seed.deserialize(toml::Value::String(key)).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let (at, value) = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("value is missing"))?;
        seed.deserialize(value)
            .inspect_err(|_| *self.failed_at = Some(at))
    }
}

/// The keys of a struct that derives `Deserialize`.
fn keys<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut keys: &'static [&'static str] = &[];
    // Always an error: the probe only notes the keys it is asked for.
    let _ = T::deserialize(KeyProbe(&mut keys));
    keys
}

/// A deserializer that notes the keys of the struct asked of it, and gives no value.
struct KeyProbe<'a>(&'a mut &'static [&'static str]);

impl<'de> Deserializer<'de> for KeyProbe<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(de::Error::custom("only the keys are read"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::sink_settings;

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Own {
        name: String,
        size: Option<u32>,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Common {
        kind: String,
        #[serde(default)]
        timeout: u32,
        label: Option<String>,
    }

    /// `Own` and `Common` as one struct: what `Flat` must read alike.
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Whole {
        name: String,
        size: Option<u32>,
        kind: String,
        #[serde(default)]
        timeout: u32,
        label: Option<String>,
    }

    #[test]
    fn a_flat_table_reads_as_one_struct_of_every_key() {
        for text in [
            "name = \"a\"\nkind = \"k\"",
            "name = \"a\"\nkind = \"k\"\nsize = 3\ntimeout = 4\nlabel = \"l\"",
            "",
            "name = \"a\"",
            "kind = \"k\"",
            "nmae = \"a\"\nkind = \"k\"",
            "name = \"a\"\nkind = \"k\"\nzzz = 1",
            "name = 1\nkind = \"k\"",
            "name = \"a\"\nkind = \"k\"\ntimeout = \"x\"",
            "aaa = 1\nname = 1",
            "name = 1\nzzz = 1",
            "timeout = \"x\"\nzzz = 1",
            "label = 1\nname = 2",
            "name = 2\nlabel = 1",
            "size = \"x\"\nlabel = 1",
            "label = 1\nsize = \"x\"",
            "timeout = -1",
            "label = \"l\"\nsize = 1",
        ] {
            let table: toml::Table = text.parse().expect("toml");
            let flat = sink_settings::<Flat<Own, Common>>(&table).map(|f| {
                let (o, s) = (f.own, f.common);
                (o.name, o.size, s.kind, s.timeout, s.label)
            });
            let whole = sink_settings::<Whole>(&table)
                .map(|w| (w.name, w.size, w.kind, w.timeout, w.label));
            assert_eq!(flat, whole, "{text:?}");
        }
    }

    #[test]
    fn the_keys_of_a_struct_are_known_without_a_value() {
        assert_eq!(keys::<Own>(), ["name", "size"]);
        assert_eq!(keys::<Common>(), ["kind", "timeout", "label"]);
    }
}
