//! Remote images. An `http://` or `https://` image URL whose host and port are in
//! `--allowed-media-domains` (`host` allows the scheme's default port, `host:port` that port) is
//! fetched (at most [`MAX_MEDIA_BYTES`], within [`FETCH_TIMEOUT`] for the whole fetch, redirects
//! included, its bytes reserved in the host-memory budget as they arrive) and handed to
//! preprocessing as a data URL; every other remote URL is refused with the reason. An answer that is
//! not an image is refused without quoting it. https runs on rustls (ring) and trusts Mozilla's root certificates (webpki-roots) plus
//! those of `--media-ca-file`. Up to [`MAX_REDIRECTS`] redirects are followed, each target checked
//! against the allowed domains as the first URL was.

use super::errors::ApiError;
use crate::preprocess::{Busy, Reserved};
use crate::UsageError;
use anyhow::Result;
use base64::Engine as _;
use http_body_util::{BodyExt, Empty};
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
    /// The allowed hosts and ports.
    allowed: Vec<Origin>,
    /// One client for both schemes, its connections pooled.
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl MediaFetcher {
    /// A fetcher for the `allowed` hosts that trusts Mozilla's roots and the certificates in the
    /// PEM file `ca_file` (`--media-ca-file`).
    pub fn new(allowed: Vec<String>, ca_file: Option<&Path>) -> Result<Self> {
        let allowed = allowed
            .iter()
            .map(|entry| {
                Origin::parse_entry(entry).ok_or_else(|| {
                    UsageError(format!(
                        "--allowed-media-domains {entry}: give a host or host:port (such as example.com or \
                         127.0.0.1:8080), not a URL"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
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
        let origin = Origin::of_url(url);
        if self.allowed.is_empty() {
            return Err(ApiError::bad_request(format!(
                "fetching remote images is off ({url}): send the image as a base64 data URL, or start the server with --allowed-media-domains {}",
                origin.entry()
            )));
        }
        if !self.allowed.iter().any(|a| a.allows(&origin)) {
            return Err(ApiError::bad_request(format!(
                "the host and port of {url} ({}) are not in --allowed-media-domains",
                origin.entry()
            )));
        }
        Ok(())
    }

    /// GETs one allowed URL, following redirects to allowed URLs: the body of the 200 answer, its
    /// bytes reserved in `held` (grown from `base`) before they arrive. The fetch must finish within
    /// [`FETCH_TIMEOUT`], not counting the time it waits for room in the budget.
    async fn fetch(&self, first: &str, held: &mut Reserved<'_>, base: u64) -> Result<Vec<u8>, ApiError> {
        let mut deadline = tokio::time::Instant::now() + FETCH_TIMEOUT;
        let late = || {
            ApiError::bad_request(format!(
                "cannot fetch the image {first}: no answer within {} s",
                FETCH_TIMEOUT.as_secs()
            ))
        };
        let mut url = first.to_string();
        let mut redirects = 0;
        loop {
            let failed = |why: String| ApiError::bad_request(format!("cannot fetch the image {url}: {why}"));
            let uri: hyper::Uri = url.parse().map_err(|e| failed(format!("{e}")))?;
            let resp = tokio::time::timeout_at(deadline, self.client.get(uri))
                .await
                .map_err(|_| late())?
                .map_err(|e| failed(with_hint(causes(&e))))?;
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
                let to = to
                    .to_str()
                    .map_err(|_| failed(format!("the server answered {status} with a Location that is not text")))?;
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
            // A declared length is reserved whole before reading, with the data URL the bytes
            // become: a request waits for all it needs rather than holding part while it waits.
            let declared = resp
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
                .filter(|&n| n <= MAX_MEDIA_BYTES);
            let mut bytes = Vec::new();
            if let Some(n) = declared {
                deadline += reserve(held, base + (n + data_url_len(n)) as u64).await?;
                bytes.reserve_exact(n);
            }
            let mut body = resp.into_body();
            loop {
                let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                    Err(_) => return Err(late()),
                    Ok(None) => break,
                    Ok(Some(frame)) => frame.map_err(|e| failed(causes(&e)))?,
                };
                let Some(data) = frame.data_ref() else { continue };
                if bytes.len() + data.len() > MAX_MEDIA_BYTES {
                    return Err(failed(format!("the image is larger than {MAX_MEDIA_BYTES} bytes")));
                }
                if bytes.len() + data.len() > bytes.capacity() {
                    let cap = (bytes.capacity() * 2)
                        .max(bytes.len() + data.len())
                        .min(MAX_MEDIA_BYTES);
                    deadline += reserve(held, base + cap as u64).await?;
                    bytes.reserve_exact(cap - bytes.len());
                }
                bytes.extend_from_slice(data);
            }
            if image::guess_format(&bytes).is_err() {
                return Err(failed(format!(
                    "the answer ({} bytes) is not a PNG, JPEG, WebP, GIF, BMP or TIFF image",
                    bytes.len()
                )));
            }
            return Ok(bytes);
        }
    }
}

/// Grows `held` to `bytes` (a 503 when the budget stays full): how long it waited, which a fetch's
/// clock does not count.
async fn reserve(held: &mut Reserved<'_>, bytes: u64) -> Result<Duration, ApiError> {
    let asked = tokio::time::Instant::now();
    held.grow_to(bytes.max(held.bytes()))
        .await
        .map_err(|Busy(why)| ApiError::unavailable(why))?;
    Ok(asked.elapsed())
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

/// A host and port that image URLs are fetched from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Origin {
    /// Lower-cased; an IPv6 literal without its brackets.
    host: String,
    port: u16,
}

impl Origin {
    /// The host and port of an `http(s)://[user@]host[:port]/…` URL (the scheme's default port
    /// when none is written; 0 for a port that is not a number).
    fn of_url(url: &str) -> Self {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", ""));
        let default = if scheme.eq_ignore_ascii_case("https") { 443 } else { 80 };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        let host_port = authority.rsplit('@').next().unwrap_or(authority);
        Self::split(host_port, default).unwrap_or(Origin {
            host: host_port.to_ascii_lowercase(),
            port: 0,
        })
    }

    /// `host`, `host:port`, `[v6]` or `[v6]:port`; `default` when no port is written.
    fn split(text: &str, default: u16) -> Option<Self> {
        let (host, port) = if let Some(v6) = text.strip_prefix('[') {
            let (host, after) = v6.split_once(']')?;
            (host, after.strip_prefix(':'))
        } else {
            match text.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (text, None),
            }
        };
        let port = match port {
            Some(p) => p.parse().ok().filter(|&p| p > 0)?,
            None => default,
        };
        Some(Origin {
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// An `--allowed-media-domains` entry: a host (ports 80 and 443 through the scheme's default)
    /// or `host:port`; `None` for a URL or anything with a path.
    fn parse_entry(entry: &str) -> Option<Self> {
        let valid = |c: char| c.is_ascii_alphanumeric() || "-.:[]_".contains(c);
        if entry.is_empty() || !entry.chars().all(valid) {
            return None;
        }
        let origin = Self::split(entry, 0)?;
        (!origin.host.is_empty()).then_some(origin)
    }

    /// Whether this entry allows a URL's origin: the same host and port, or for an entry without a
    /// port (0) the same host on a scheme's default port.
    fn allows(&self, url: &Origin) -> bool {
        self.host == url.host && (self.port == url.port || (self.port == 0 && matches!(url.port, 80 | 443)))
    }

    /// How `--allowed-media-domains` spells it.
    fn entry(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!("{host}:{}", self.port)
    }
}

/// `text` with a hint when rustls refused a CA certificate as the server's own (`openssl req
/// -x509` writes `CA:TRUE` by default).
fn with_hint(text: String) -> String {
    if text.contains("CaUsedAsEndEntity") {
        format!(
            "{text} (the server presents a CA certificate as its own: give it a certificate with \
             basicConstraints CA:FALSE, e.g. `openssl req -x509 ... -addext basicConstraints=critical,CA:FALSE`, \
             or one issued by the CA in --media-ca-file)"
        )
    } else {
        text
    }
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

/// The length of the data URL [`resolve_remote_images`] makes of `n` bytes.
fn data_url_len(n: usize) -> usize {
    DATA_URL_PREFIX.len() + n.div_ceil(3) * 4
}

/// What a fetched image's data URL starts with.
const DATA_URL_PREFIX: &str = "data:application/octet-stream;base64,";

/// Replaces every allowed `http(s)://` image URL in `messages` by a data URL of its bytes; refuses
/// the other remote URLs. Data URLs and paths are left for preprocessing to judge. `held` (the
/// request's reservation in the host-memory budget) grows by each fetched image as it arrives,
/// then keeps its data URL; at the end it also takes the bytes that decoding every data URL will
/// hold while the request is preprocessed.
pub async fn resolve_remote_images(
    messages: &mut [ChatMessage],
    media: &MediaFetcher,
    held: &mut Reserved<'_>,
) -> Result<(), ApiError> {
    for url in messages.iter_mut().flat_map(ChatMessage::image_urls_mut) {
        let trimmed = url.trim();
        if !is_remote(trimmed) {
            continue;
        }
        media.check(trimmed)?;
        let base = held.bytes();
        let bytes = media.fetch(trimmed, held, base).await?;
        let encoded_len = data_url_len(bytes.len());
        held.grow_to((base + (bytes.len() + encoded_len) as u64).max(held.bytes()))
            .await
            .map_err(|Busy(why)| ApiError::unavailable(why))?;
        let mut data_url = String::with_capacity(encoded_len);
        data_url.push_str(DATA_URL_PREFIX);
        base64::engine::general_purpose::STANDARD.encode_string(&bytes, &mut data_url);
        drop(bytes);
        *url = data_url;
        held.shrink_to(base + encoded_len as u64);
    }
    // Preprocessing decodes every data URL's payload (three bytes for every four) before it
    // decodes the images.
    let decoded: usize = messages
        .iter_mut()
        .flat_map(ChatMessage::image_urls_mut)
        .filter(|u| u.trim_start().starts_with("data:"))
        .map(|u| u.len() / 4 * 3)
        .sum();
    held.grow_to(held.bytes() + decoded as u64)
        .await
        .map_err(|Busy(why)| ApiError::unavailable(why))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_urls_need_an_allowed_host() {
        let fetcher = |allowed: &[&str]| MediaFetcher::new(allowed.iter().map(|d| d.to_string()).collect(), None);
        let origin = |host: &str, port| Origin {
            host: host.into(),
            port,
        };
        assert_eq!(
            Origin::of_url("http://user@Example.COM:8080/a.png?x"),
            origin("example.com", 8080)
        );
        assert_eq!(Origin::of_url("https://[::1]/a.png"), origin("::1", 443));
        assert_eq!(Origin::of_url("http://a.org/a.png").entry(), "a.org:80");
        let e = fetcher(&[]).unwrap().check("http://example.com/a.png").unwrap_err();
        assert!(e.message.contains("--allowed-media-domains example.com:80"), "{e}");
        let allowed = fetcher(&["example.com", "127.0.0.1:8080", "[::1]:9000"]).unwrap();
        let e = allowed.check("https://user@evil.org:8443/a.png").unwrap_err();
        assert!(e.message.contains("not in --allowed-media-domains"), "{e}");
        assert!(allowed.check("https://example.com/a.png").is_ok());
        assert!(allowed.check("http://Example.com:80/a.png").is_ok());
        // Per port: another port of an allowed host is another service.
        assert!(allowed.check("http://example.com:81/a.png").is_err());
        assert!(allowed.check("http://127.0.0.1:8080/a.png").is_ok());
        assert!(allowed.check("http://127.0.0.1:8081/a.png").is_err());
        assert!(allowed.check("http://127.0.0.1/a.png").is_err());
        assert!(allowed.check("http://[::1]:9000/a.png").is_ok());
        // Entries that can never match are refused at start-up.
        for bad in ["http://x/y", "x/y", "", "x:0", "x:99999", "[::1"] {
            let e = fetcher(&[bad]).unwrap_err().to_string();
            assert!(e.contains("give a host or host:port"), "{bad}: {e}");
        }
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
