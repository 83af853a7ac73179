//! Remote images. An `http://` or `https://` image URL whose host is in `--allowed-media-domains` is
//! fetched (at most [`MAX_MEDIA_BYTES`], within [`FETCH_TIMEOUT`] for the whole fetch, redirects
//! included) and handed to preprocessing as a data URL; every other remote URL is refused with the
//! reason. https runs on rustls (ring) and trusts Mozilla's root certificates (webpki-roots) plus
//! those of `--media-ca-file`. Up to [`MAX_REDIRECTS`] redirects are followed, each target checked
//! against the allowed domains as the first URL was.

use super::errors::ApiError;
use crate::UsageError;
use anyhow::Result;
use base64::Engine as _;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvlens_engine::input::chat::ChatMessage;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Largest image body fetched.
pub const MAX_MEDIA_BYTES: usize = 64 << 20;

/// Longest a fetch may take, redirects included.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Most redirects followed for one image.
pub const MAX_REDIRECTS: usize = 3;

/// Fetches the image URLs that `--allowed-media-domains` allows.
#[derive(Debug)]
pub struct MediaFetcher {
    /// The allowed hosts.
    allowed: Vec<String>,
    /// One client for both schemes, its connections pooled.
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl MediaFetcher {
    /// A fetcher for the `allowed` hosts that trusts Mozilla's roots and the certificates in the
    /// PEM file `ca_file` (`--media-ca-file`).
    pub fn new(allowed: Vec<String>, ca_file: Option<&Path>) -> Result<Self> {
        let mut roots = rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(path) = ca_file {
            let bad = |why: String| UsageError(format!("--media-ca-file {}: {why}", path.display()));
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| bad(e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("no PEM certificate in the file".into()).into());
            }
            for cert in certs {
                roots.add(cert).map_err(|e| bad(e.to_string()))?;
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(MediaFetcher {
            allowed,
            client: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    /// Whether `url` may be fetched; the refusal says why.
    fn check(&self, url: &str) -> Result<(), ApiError> {
        let host = host_of(url);
        if self.allowed.is_empty() {
            return Err(ApiError::bad_request(format!(
                "fetching remote images is off ({url}): send the image as a base64 data URL, or start the server with --allowed-media-domains {host}"
            )));
        }
        if !self.allowed.iter().any(|d| d.eq_ignore_ascii_case(&host)) {
            return Err(ApiError::bad_request(format!(
                "the domain of {url} is not in --allowed-media-domains"
            )));
        }
        Ok(())
    }

    /// GETs one allowed URL, following redirects to allowed URLs: the body of the 200 answer.
    async fn fetch(&self, first: &str) -> Result<Bytes, ApiError> {
        let get = async {
            let mut url = first.to_string();
            let mut redirects = 0;
            loop {
                let failed = |why: String| ApiError::bad_request(format!("cannot fetch the image {url}: {why}"));
                let uri: hyper::Uri = url.parse().map_err(|e| failed(format!("{e}")))?;
                let resp = self.client.get(uri).await.map_err(|e| failed(causes(&e)))?;
                let status = resp.status();
                if status.is_redirection() {
                    let Some(to) = resp.headers().get(hyper::header::LOCATION) else {
                        return Err(failed(format!("the server answered {status} without a Location")));
                    };
                    if redirects == MAX_REDIRECTS {
                        return Err(failed(format!(
                            "more than {MAX_REDIRECTS} redirects (the last to {})",
                            String::from_utf8_lossy(to.as_bytes())
                        )));
                    }
                    let to = to.to_str().map_err(|_| {
                        failed(format!("the server answered {status} with a Location that is not text"))
                    })?;
                    let next = resolve(&url, to);
                    if !is_remote(&next) {
                        return Err(failed(format!(
                            "the server redirected to {next}, which is not an http(s) URL"
                        )));
                    }
                    self.check(&next)
                        .map_err(|e| failed(format!("redirected: {}", e.message)))?;
                    url = next;
                    redirects += 1;
                    continue;
                }
                if status != hyper::StatusCode::OK {
                    return Err(failed(format!("the server answered {status}")));
                }
                return Limited::new(resp.into_body(), MAX_MEDIA_BYTES)
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .map_err(|e| failed(format!("{e} (at most {MAX_MEDIA_BYTES} bytes)")));
            }
        };
        tokio::time::timeout(FETCH_TIMEOUT, get).await.map_err(|_| {
            ApiError::bad_request(format!(
                "cannot fetch the image {first}: no answer within {} s",
                FETCH_TIMEOUT.as_secs()
            ))
        })?
    }
}

/// An error and its causes, outermost first (hyper's own message alone says only "client error").
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Whether `url` starts with `http://` or `https://` (in any case).
fn is_remote(url: &str) -> bool {
    ["http://", "https://"]
        .iter()
        .any(|p| url.get(..p.len()).is_some_and(|s| s.eq_ignore_ascii_case(p)))
}

/// The host of an `http(s)://[user@]host[:port]/…` URL, lower-cased.
fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or("", |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or(authority);
    // An IPv6 literal keeps its brackets' content: `[::1]:8080` → `::1`.
    if let Some(v6) = host.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6).to_ascii_lowercase();
    }
    host.split(':').next().unwrap_or(host).to_ascii_lowercase()
}

/// A redirect's `Location` made absolute against the URL that answered it.
fn resolve(base: &str, location: &str) -> String {
    let location = location.trim();
    // Absolute when it starts with a scheme (letters, digits, `+`, `-`, `.` before `://`).
    let scheme_len = location.find("://").filter(|&i| {
        i > 0
            && location[..i]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    });
    if scheme_len.is_some() {
        return location.to_string();
    }
    let (scheme, rest) = base.split_once("://").unwrap_or(("http", base));
    if let Some(authority_and_path) = location.strip_prefix("//") {
        return format!("{scheme}://{authority_and_path}");
    }
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let origin = format!("{scheme}://{}", &rest[..authority_end]);
    if location.starts_with('/') {
        return format!("{origin}{location}");
    }
    // Relative to the base's directory.
    let path = rest[authority_end..].split(['?', '#']).next().unwrap_or("");
    let dir = path.rfind('/').map_or("/", |i| &path[..=i]);
    format!("{origin}{dir}{location}")
}

/// Replaces every allowed `http(s)://` image URL in `messages` by a data URL of its bytes; refuses
/// the other remote URLs. Data URLs and paths are left for preprocessing to judge.
pub async fn resolve_remote_images(messages: &mut [ChatMessage], media: &MediaFetcher) -> Result<(), ApiError> {
    for url in messages.iter_mut().flat_map(ChatMessage::image_urls_mut) {
        let trimmed = url.trim();
        if !is_remote(trimmed) {
            continue;
        }
        media.check(trimmed)?;
        let bytes = media.fetch(trimmed).await?;
        *url = format!(
            "data:application/octet-stream;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&bytes)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_urls_need_an_allowed_host() {
        let fetcher = |allowed: &[&str]| MediaFetcher::new(allowed.iter().map(|d| d.to_string()).collect(), None);
        assert_eq!(host_of("http://user@Example.COM:8080/a.png?x"), "example.com");
        assert_eq!(host_of("http://[::1]:8080/a.png"), "::1");
        let e = fetcher(&[]).unwrap().check("http://example.com/a.png").unwrap_err();
        assert!(e.message.contains("--allowed-media-domains example.com"), "{e}");
        let allowed = fetcher(&["example.com"]).unwrap();
        let e = allowed.check("https://user@evil.org:8443/a.png").unwrap_err();
        assert!(e.message.contains("not in --allowed-media-domains"), "{e}");
        assert!(allowed.check("https://example.com/a.png").is_ok());
        assert!(allowed.check("http://example.com:81/a.png").is_ok());
    }

    #[test]
    fn redirect_locations_resolve_against_the_url() {
        let base = "https://a.org:8443/img/cat.png?size=2";
        assert_eq!(resolve(base, "http://b.org/x.png"), "http://b.org/x.png");
        assert_eq!(resolve(base, "//c.org/y.png"), "https://c.org/y.png");
        assert_eq!(resolve(base, "/z.png"), "https://a.org:8443/z.png");
        assert_eq!(resolve(base, "dog.png"), "https://a.org:8443/img/dog.png");
        assert_eq!(resolve("http://a.org", "dog.png"), "http://a.org/dog.png");
        assert_eq!(
            resolve(base, "/img?u=http://x.org/a.png"),
            "https://a.org:8443/img?u=http://x.org/a.png"
        );
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let e = MediaFetcher::new(Vec::new(), Some(&path)).unwrap_err().to_string();
        assert!(e.contains("no PEM certificate"), "{e}");
        let e = MediaFetcher::new(Vec::new(), Some(&dir.path().join("absent.pem")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--media-ca-file"), "{e}");
    }
}
