//! A destination's subscription: which events it takes, by their topic (globs) and a filter over
//! the whole event. Plain data: the configuration file fills it in, routing
//! ([`crate::route::Router`]) follows it.

use super::filter::Filter;

/// Which events a destination takes: those whose topic matches one of its globs (every topic when
/// it has none) and that its filter, if any, keeps.
#[derive(Debug, Clone, Default)]
pub struct Subscription {
    /// Topic globs (`order.*`); empty matches every topic. Checked when they are loaded
    /// ([`topic_glob`]): an invalid glob matches nothing.
    pub topics: Vec<String>,
    /// A CEL expression an event must also satisfy.
    pub filter: Option<Filter>,
}

/// A topic glob, compiled: `*` any run of characters (dots included), `?` one character,
/// `[abc]`/`[!abc]` one of a set, `{a,b}` either; the error says what is wrong.
pub fn topic_glob(glob: &str) -> Result<globset::Glob, String> {
    globset::GlobBuilder::new(glob)
        .literal_separator(false)
        .backslash_escape(true)
        .build()
        .map_err(|e| e.kind().to_string())
}

/// Whether `glob` matches only the topic it spells (no wildcard): looked up, not matched.
pub fn is_exact_topic(glob: &str) -> bool {
    !glob.contains(['*', '?', '[', ']', '{', '}', '\\'])
}

impl AsRef<Subscription> for Subscription {
    fn as_ref(&self) -> &Subscription {
        self
    }
}
