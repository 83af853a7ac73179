//! Which pages and names may drive this server. Two checks run before any route:
//!
//! - **Host** (DNS rebinding): a server bound to a loopback address answers only requests whose
//!   `Host` names the machine itself (`localhost`, `*.localhost`, a loopback address) or a name in
//!   `--allowed-hosts`, so a page whose own domain was re-pointed at 127.0.0.1 cannot reach it.
//!   Servers bound elsewhere take any `Host` unless `--allowed-hosts` lists them.
//! - **Cross-site POSTs**: a browser sends a cross-origin POST whose body is text, a form or
//!   multipart (or has no body) without asking the server first (no CORS preflight), so
//!   `--allowed-origins` could only hide the answer. A POST from another origin must therefore say
//!   `Content-Type: application/json`, which a browser sends cross-origin only after a preflight
//!   that `--allowed-origins` allowed; clients that are not browsers send no `Origin` and are not
//!   affected. (Bodies must be JSON on every route that reads one, whatever the origin.)

use axum::http::{header, HeaderMap, Method};
use std::net::IpAddr;

/// The host rules of a server.
#[derive(Debug, Clone)]
pub struct SiteRules {
    /// The server listens on a loopback address.
    loopback: bool,
    /// `--allowed-hosts`, lower-cased (`*`: any).
    allowed_hosts: Vec<String>,
}

/// The host of a `Host` header or an origin's authority, lower-cased, without port, brackets or a
/// trailing dot.
fn host_name(authority: &str) -> String {
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority.split(':').next().unwrap_or(authority),
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

impl SiteRules {
    /// The rules of a server bound to a loopback address or not, with `--allowed-hosts`.
    pub fn new(loopback: bool, allowed_hosts: &[String]) -> Self {
        SiteRules {
            loopback,
            allowed_hosts: allowed_hosts.iter().map(|h| host_name(h.trim())).collect(),
        }
    }

    /// Whether a request with this `Host` header is served (a request without one is: browsers
    /// always send it).
    pub fn host_allowed(&self, host: Option<&str>) -> bool {
        let Some(host) = host.map(host_name) else {
            return true;
        };
        if self.allowed_hosts.iter().any(|h| h == "*" || *h == host) {
            return true;
        }
        if !self.loopback {
            return self.allowed_hosts.is_empty();
        }
        host == "localhost" || host.ends_with(".localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
    }
}

/// Whether a request is a POST that a page of another origin could have sent without a CORS
/// preflight: it carries an `Origin` other than the server's own (`Host`) and is not JSON.
pub fn unasked_cross_site_post(method: &Method, headers: &HeaderMap) -> bool {
    if method != Method::POST || super::generate::is_json(headers) {
        return false;
    }
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let own = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let authority = origin.split_once("://").map(|(_, rest)| rest);
    !matches!((authority, own), (Some(a), Some(h)) if a.eq_ignore_ascii_case(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_server_answers_its_own_names_only() {
        let rules = SiteRules::new(true, &[]);
        for host in [
            "127.0.0.1:8000",
            "localhost",
            "LOCALHOST:1",
            "app.localhost",
            "[::1]:8000",
            "127.1.2.3",
        ] {
            assert!(rules.host_allowed(Some(host)), "{host}");
        }
        for host in ["evil.example:8000", "192.168.1.5", "localhost.evil.example", "[::2]"] {
            assert!(!rules.host_allowed(Some(host)), "{host}");
        }
        assert!(rules.host_allowed(None));
        let rules = SiteRules::new(true, &["Box.lan".into()]);
        assert!(rules.host_allowed(Some("box.lan:8000")));
        assert!(SiteRules::new(true, &["*".into()]).host_allowed(Some("anything")));
        // Bound elsewhere: any host unless listed.
        assert!(SiteRules::new(false, &[]).host_allowed(Some("10.0.0.2:8000")));
        let listed = SiteRules::new(false, &["api.lan".into()]);
        assert!(listed.host_allowed(Some("api.lan")) && !listed.host_allowed(Some("other.lan")));
    }

    #[test]
    fn only_cross_origin_posts_that_skip_the_preflight_are_refused() {
        let headers = |pairs: &[(header::HeaderName, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(k.clone(), v.parse().unwrap());
            }
            h
        };
        let host = (header::HOST, "127.0.0.1:8000");
        let evil = (header::ORIGIN, "https://evil.example");
        let text = (header::CONTENT_TYPE, "text/plain");
        let json = (header::CONTENT_TYPE, "application/json; charset=utf-8");
        let post = Method::POST;
        assert!(unasked_cross_site_post(
            &post,
            &headers(&[host.clone(), evil.clone(), text.clone()])
        ));
        assert!(unasked_cross_site_post(&post, &headers(&[host.clone(), evil.clone()])));
        assert!(unasked_cross_site_post(
            &post,
            &headers(&[host.clone(), (header::ORIGIN, "null")])
        ));
        assert!(!unasked_cross_site_post(
            &post,
            &headers(&[host.clone(), evil.clone(), json])
        ));
        assert!(!unasked_cross_site_post(&Method::GET, &headers(&[host.clone(), evil])));
        let own = (header::ORIGIN, "http://127.0.0.1:8000");
        assert!(!unasked_cross_site_post(
            &post,
            &headers(&[host.clone(), own, text.clone()])
        ));
        assert!(!unasked_cross_site_post(&post, &headers(&[host, text])));
    }
}
