//! Routing: which destination an event goes to (the first whose topic globs match).

use glob::Pattern;

use crate::config::DestinationConfig;

/// Topic globs of every destination, in configuration order.
#[derive(Debug, Clone)]
pub struct Router {
    routes: Vec<Vec<Pattern>>,
}

impl Router {
    /// Builds the router; globs were validated with the configuration, invalid ones match nothing.
    pub fn new(destinations: &[DestinationConfig]) -> Self {
        let routes = destinations
            .iter()
            .map(|d| {
                d.topics
                    .iter()
                    .filter_map(|g| Pattern::new(g).ok())
                    .collect()
            })
            .collect();
        Self { routes }
    }

    /// The index of the destination for `topic`, or `None` when no destination takes it.
    pub fn route(&self, topic: &str) -> Option<usize> {
        self.routes
            .iter()
            .position(|globs| globs.is_empty() || globs.iter().any(|g| g.matches(topic)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn first_matching_destination_wins() {
        let c = Config::parse(
            r#"
[[destinations]]
name = "orders"
type = "null"
topics = ["order.*"]
[[destinations]]
name = "payments"
type = "null"
topics = ["payment.*", "refund.created"]
"#,
            |_| None,
        )
        .expect("valid");
        let r = Router::new(&c.destinations);
        assert_eq!(r.route("order.created"), Some(0));
        assert_eq!(r.route("payment.failed"), Some(1));
        assert_eq!(r.route("refund.created"), Some(1));
        assert_eq!(r.route("user.signed_up"), None);
    }
}
