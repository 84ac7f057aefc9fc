//! Presigned URLs of the store's objects: SigV4 query-string authentication (the signature
//! and its parameters in the URL), signed by `rusty-s3` with the store's own endpoint,
//! bucket, region, keys and path style. object_store's signer cannot serve here: it signs
//! the `host` header only, and a create-only PUT needs `if-none-match` signed too.
//!
//! A URL is a bearer capability until it expires: whoever holds it may do what it names,
//! and nothing else (another object, another method, another precondition or ACL change
//! the string to sign, so the engine answers 403). A create signs the headers of
//! [`Presign::headers`]; headers it does not sign (user metadata, content type) the
//! engine may still apply, to that one object.

use crate::{S3Location, S3Settings};
use kochab_store::Presign;
use rusty_s3::actions::{GetObject, PutObject, S3Action};
use rusty_s3::{Bucket, Credentials, UrlStyle};
use std::io::{self, ErrorKind};
use std::time::Duration;

/// Longest life of a presigned URL: S3 refuses an `X-Amz-Expires` above 7 days.
pub const PRESIGN_EXPIRY_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
/// Shortest: `X-Amz-Expires` counts whole seconds from 1.
const PRESIGN_EXPIRY_MIN: Duration = Duration::from_secs(1);
/// Signs URLs for the objects of one bucket under one prefix.
pub(crate) struct Presigner {
    bucket: Bucket,
    credentials: Credentials,
    /// "" or "PREFIX/", as the store's keys.
    prefix: String,
}

impl std::fmt::Debug for Presigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Presigner")
            .field("base_url", &self.bucket.base_url().as_str())
            .finish_non_exhaustive()
    }
}

impl Presigner {
    /// The signer of the store at `location`, reached with `settings`, requests in path
    /// style as the store's own client makes them (`ENDPOINT/BUCKET/KEY`; on AWS without
    /// an endpoint, `https://s3.REGION.amazonaws.com/BUCKET/KEY`).
    pub(crate) fn open(location: &S3Location, settings: &S3Settings) -> io::Result<Presigner> {
        let endpoint = settings
            .endpoint
            .clone()
            .unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", settings.region));
        let credentials = match &settings.session_token {
            Some(t) => {
                Credentials::new_with_token(&settings.access_key_id, &settings.secret_access_key, t)
            }
            None => Credentials::new(&settings.access_key_id, &settings.secret_access_key),
        };
        Presigner::new(
            &endpoint,
            UrlStyle::Path,
            &location.bucket,
            &settings.region,
            credentials,
            &location.prefix,
        )
    }

    pub(crate) fn new(
        endpoint: &str,
        style: UrlStyle,
        bucket: &str,
        region: &str,
        credentials: Credentials,
        prefix: &str,
    ) -> io::Result<Presigner> {
        let bad = |e: String| {
            io::Error::new(
                ErrorKind::InvalidInput,
                format!("cannot presign for bucket {bucket} at {endpoint}: {e}"),
            )
        };
        let url = endpoint.parse().map_err(|e| bad(format!("{e}")))?;
        let bucket = Bucket::new(url, style, bucket.to_string(), region.to_string())
            .map_err(|e| bad(e.to_string()))?;
        let prefix = prefix.trim_matches('/');
        Ok(Presigner {
            bucket,
            credentials,
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
        })
    }

    /// A URL for `how` on object `name` (a valid object name), valid for `expires_in`
    /// clamped to 1 s..7 days, from now.
    pub(crate) fn url(&self, name: &str, how: Presign, expires_in: Duration) -> String {
        self.url_at(name, how, expires_in, &jiff::Timestamp::now())
    }

    /// The same, signed as at `time` (tests check it against AWS's published example).
    pub(crate) fn url_at(
        &self,
        name: &str,
        how: Presign,
        expires_in: Duration,
        time: &jiff::Timestamp,
    ) -> String {
        let key = format!("{}{name}", self.prefix);
        // Whole seconds, rounded up so that a caller never gets less than it asked for.
        let secs = expires_in.as_secs() + u64::from(expires_in.subsec_nanos() > 0);
        let expires = Duration::from_secs(secs).clamp(PRESIGN_EXPIRY_MIN, PRESIGN_EXPIRY_MAX);
        let creds = Some(&self.credentials);
        match how {
            Presign::Get => GetObject::new(&self.bucket, creds, &key).sign_with_time(expires, time),
            Presign::PutCreate => {
                let mut put = PutObject::new(&self.bucket, creds, &key);
                for (name, value) in how.headers() {
                    put.headers_mut().insert(*name, *value);
                }
                put.sign_with_time(expires, time)
            }
        }
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's published example of a presigned URL (Signature Version 4, "Authenticating
    /// Requests: Using Query Parameters", GET of examplebucket/test.txt on 24 May 2013).
    const AWS_KEY: &str = "AKIAIOSFODNN7EXAMPLE";
    const AWS_SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const AWS_EXAMPLE_URL: &str = "https://examplebucket.s3.amazonaws.com/test.txt?\
        X-Amz-Algorithm=AWS4-HMAC-SHA256\
        &X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request\
        &X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host\
        &X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404";

    fn at_2013_05_24() -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_369_353_600).unwrap()
    }

    #[test]
    fn signs_aws_published_example() {
        let p = Presigner::new(
            "https://s3.amazonaws.com",
            UrlStyle::VirtualHost,
            "examplebucket",
            "us-east-1",
            Credentials::new(AWS_KEY, AWS_SECRET),
            "",
        )
        .unwrap();
        let url = p.url_at(
            "test.txt",
            Presign::Get,
            Duration::from_secs(86400),
            &at_2013_05_24(),
        );
        assert_eq!(url, AWS_EXAMPLE_URL);
    }

    fn rgw_like(prefix: &str) -> Presigner {
        let location = S3Location::parse(&format!("s3://kochab-test/{prefix}")).unwrap();
        let vars = [
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:17480"),
            ("AWS_ACCESS_KEY_ID", AWS_KEY),
            ("AWS_SECRET_ACCESS_KEY", AWS_SECRET),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        Presigner::open(&location, &S3Settings::from_vars(&vars).unwrap()).unwrap()
    }

    fn query(url: &str, name: &str) -> String {
        url.split_once('?')
            .unwrap()
            .1
            .split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {url}"))
            .to_string()
    }

    #[test]
    fn path_style_under_the_prefix_and_create_signs_if_none_match() {
        let p = rgw_like("cluster-a");
        let t = at_2013_05_24();
        let get = p.url_at("data/1/x", Presign::Get, Duration::from_secs(60), &t);
        assert!(
            get.starts_with("http://127.0.0.1:17480/kochab-test/cluster-a/data/1/x?"),
            "{get}"
        );
        assert_eq!(query(&get, "X-Amz-SignedHeaders"), "host");
        let put = p.url_at("data/1/x", Presign::PutCreate, Duration::from_secs(60), &t);
        assert_eq!(
            query(&put, "X-Amz-SignedHeaders"),
            "host%3Bif-none-match%3Bx-amz-acl"
        );
        assert_ne!(
            query(&get, "X-Amz-Signature"),
            query(&put, "X-Amz-Signature")
        );
        // Another object, another signature.
        let other = p.url_at("data/1/y", Presign::PutCreate, Duration::from_secs(60), &t);
        assert_ne!(
            query(&put, "X-Amz-Signature"),
            query(&other, "X-Amz-Signature")
        );
    }

    #[test]
    fn expiry_is_clamped_to_what_s3_accepts() {
        let p = rgw_like("");
        let t = at_2013_05_24();
        let expires = |d| query(&p.url_at("a", Presign::Get, d, &t), "X-Amz-Expires");
        assert_eq!(expires(Duration::from_secs(3600 * 24 * 30)), "604800");
        assert_eq!(expires(Duration::ZERO), "1");
        assert_eq!(expires(Duration::from_millis(1500)), "2");
        assert_eq!(expires(Duration::from_secs(300)), "300");
    }
}
