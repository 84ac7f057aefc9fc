//! Where the store is (`s3://BUCKET/PREFIX`) and how to reach it: endpoint, region and keys
//! from the standard AWS variables or a file of them, never from the command line.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// A bucket and a prefix in it, from `s3://BUCKET/PREFIX`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Location {
    pub bucket: String,
    /// Object-name components joined by '/', without leading or trailing '/'; may be empty.
    pub prefix: String,
}

/// Longest bucket name S3 allows.
const BUCKET_MAX: usize = 63;
/// Shortest bucket name S3 allows.
const BUCKET_MIN: usize = 3;
/// Longest prefix accepted: object names under it must still fit S3's 1024-byte keys.
const PREFIX_MAX: usize = 256;

impl S3Location {
    /// Parses `s3://BUCKET[/PREFIX]`. The bucket follows S3's naming rules (3-63 of
    /// `[a-z0-9.-]`, starting and ending with a letter or digit); the prefix is made of
    /// object-name components (`[A-Za-z0-9._-]`, no empty, "." or ".." ones).
    pub fn parse(url: &str) -> Result<S3Location, String> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| format!("{url:?} is not s3://BUCKET/PREFIX"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        let bucket_ok = (BUCKET_MIN..=BUCKET_MAX).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
            && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
            && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !bucket_ok {
            return Err(format!(
                "{url:?}: {bucket:?} is not a bucket name (3-63 of a-z, 0-9, '.', '-')"
            ));
        }
        if !prefix.is_empty()
            && (prefix.len() > PREFIX_MAX || kochab_store::validate_object_name(prefix).is_err())
        {
            return Err(format!(
                "{url:?}: the prefix {prefix:?} must be components of A-Z, a-z, 0-9, '.', '_', \
                 '-' joined by '/' (at most {PREFIX_MAX} bytes)"
            ));
        }
        Ok(S3Location {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }
}

impl fmt::Display for S3Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// The variables read, from the environment or the file. Instance-metadata, web-identity
/// and container credentials (which object_store would otherwise try, reaching for
/// addresses off this machine) are deliberately not among them: keys are given.
pub const VARIABLES: &[&str] = &[
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
];

/// Region when none is given (what most S3-compatible engines, Ceph RGW among them, accept).
const DEFAULT_REGION: &str = "us-east-1";

/// Largest settings file read (a handful of lines; anything bigger is a mistake).
const SETTINGS_FILE_MAX: u64 = 64 << 10;

/// How to reach the store. The secret never appears in `Debug` output or messages.
#[derive(Clone)]
pub struct S3Settings {
    /// `http(s)://host:port` of an S3-compatible engine; `None` for AWS S3 itself.
    pub endpoint: Option<String>,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub region: String,
    pub allow_http: bool,
}

impl fmt::Debug for S3Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Settings")
            .field("endpoint", &self.endpoint)
            .field("access_key_id", &self.access_key_id)
            .field("region", &self.region)
            .field("allow_http", &self.allow_http)
            .finish_non_exhaustive()
    }
}

impl S3Settings {
    /// The settings from the environment, with those in `file` (if given) taking precedence.
    pub fn load(file: Option<&Path>) -> Result<S3Settings, String> {
        let mut vars: BTreeMap<String, String> = VARIABLES
            .iter()
            .filter_map(|k| Some((k.to_string(), std::env::var(k).ok()?)))
            .collect();
        if let Some(path) = file {
            vars.extend(read_settings_file(path)?);
        }
        S3Settings::from_vars(&vars)
    }

    /// The settings from variables named as in [`VARIABLES`].
    pub fn from_vars(vars: &BTreeMap<String, String>) -> Result<S3Settings, String> {
        let get = |k: &str| {
            vars.get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let (Some(access_key_id), Some(secret_access_key)) =
            (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY"))
        else {
            return Err(
                "the store on S3 needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                 (in the environment or the --store-env file)"
                    .to_string(),
            );
        };
        let allow_http = match get("AWS_ALLOW_HTTP").as_deref() {
            None | Some("false" | "0" | "no") => false,
            Some("true" | "1" | "yes") => true,
            Some(other) => return Err(format!("AWS_ALLOW_HTTP={other:?}: true or false")),
        };
        let endpoint = get("AWS_ENDPOINT_URL").map(|e| e.trim_end_matches('/').to_string());
        if let Some(e) = &endpoint {
            if e.starts_with("http://") && !allow_http {
                return Err(format!(
                    "AWS_ENDPOINT_URL={e} is plain HTTP (keys and data in clear): set \
                     AWS_ALLOW_HTTP=true to accept that"
                ));
            }
            if !e.starts_with("http://") && !e.starts_with("https://") {
                return Err(format!(
                    "AWS_ENDPOINT_URL={e:?} is not an http:// or https:// URL"
                ));
            }
        }
        Ok(S3Settings {
            endpoint,
            access_key_id,
            secret_access_key,
            session_token: get("AWS_SESSION_TOKEN"),
            region: get("AWS_REGION")
                .or_else(|| get("AWS_DEFAULT_REGION"))
                .unwrap_or_else(|| DEFAULT_REGION.to_string()),
            allow_http,
        })
    }

    /// Where requests go, for messages.
    pub fn endpoint_name(&self) -> String {
        match &self.endpoint {
            Some(e) => e.clone(),
            None => format!("AWS S3 ({})", self.region),
        }
    }
}

/// Reads a settings file: `NAME=VALUE` lines, each optionally preceded by `export ` (so
/// that a shell can source the same file), values optionally in single or double quotes;
/// blank lines and `#` comments are skipped. Names in [`VARIABLES`] are taken, other
/// `AWS_*` names are refused (a misspelt one would be silently ignored otherwise), and
/// any other name is left alone. The file holds a secret: it is refused if group or
/// others may read it, as the cluster's key files are.
pub fn read_settings_file(path: &Path) -> Result<BTreeMap<String, String>, String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{shown} has mode {mode:o}; it holds a secret key and must be 0600"
        ));
    }
    let mut text = String::new();
    file.take(SETTINGS_FILE_MAX)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mut vars = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line).trim_start();
        let Some((name, value)) = line.split_once('=') else {
            return Err(format!("{shown}:{}: not NAME=VALUE", i + 1));
        };
        let name = name.trim();
        let value = value.trim();
        let value = [('"', '"'), ('\'', '\'')]
            .iter()
            .find_map(|(a, b)| value.strip_prefix(*a)?.strip_suffix(*b))
            .unwrap_or(value);
        if VARIABLES.contains(&name) {
            vars.insert(name.to_string(), value.to_string());
        } else if name.starts_with("AWS_") {
            return Err(format!(
                "{shown}:{}: {name} is not one of {}",
                i + 1,
                VARIABLES.join(", ")
            ));
        }
    }
    Ok(vars)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_and_bad_ones_are_refused() {
        let l = S3Location::parse("s3://kochab-test/a/b").unwrap();
        assert_eq!(
            (l.bucket.as_str(), l.prefix.as_str()),
            ("kochab-test", "a/b")
        );
        assert_eq!(l.to_string(), "s3://kochab-test/a/b");
        let l = S3Location::parse("s3://bkt/").unwrap();
        assert_eq!(l.prefix, "");
        assert_eq!(l.to_string(), "s3://bkt");
        for bad in [
            "bkt/x",
            "file:///tmp",
            "s3://",
            "s3://ab",
            "s3://Upper",
            "s3://-bkt",
            "s3://bkt/../x",
            "s3://bkt/a//b",
            "s3://bkt/sp ace",
        ] {
            assert!(S3Location::parse(bad).is_err(), "{bad}");
        }
    }

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn settings_need_keys_and_refuse_http_unless_allowed() {
        assert!(S3Settings::from_vars(&vars(&[])).is_err());
        let keys = [
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "very-secret"),
        ];
        let s = S3Settings::from_vars(&vars(&keys)).unwrap();
        assert_eq!(s.region, DEFAULT_REGION);
        assert!(!format!("{s:?}").contains("very-secret"));
        let mut v = vars(&keys);
        v.insert("AWS_ENDPOINT_URL".into(), "http://127.0.0.1:1/".into());
        let e = S3Settings::from_vars(&v).unwrap_err();
        assert!(e.contains("AWS_ALLOW_HTTP"), "{e}");
        v.insert("AWS_ALLOW_HTTP".into(), "true".into());
        v.insert("AWS_DEFAULT_REGION".into(), "eu-west-3".into());
        let s = S3Settings::from_vars(&v).unwrap();
        assert_eq!(s.endpoint.as_deref(), Some("http://127.0.0.1:1"));
        assert_eq!(s.region, "eu-west-3");
        v.insert("AWS_ALLOW_HTTP".into(), "maybe".into());
        assert!(S3Settings::from_vars(&v).is_err());
    }

    #[test]
    fn settings_files_are_read_and_loose_ones_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("env");
        std::fs::write(
            &p,
            "# test user\nexport AWS_ACCESS_KEY_ID=AK\nAWS_SECRET_ACCESS_KEY='s k'\n\n\
             CEPH_CONF=/x\nexport AWS_REGION=\"r1\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_settings_file(&p).unwrap_err();
        assert!(e.contains("0600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let v = read_settings_file(&p).unwrap();
        assert_eq!(
            v,
            vars(&[
                ("AWS_ACCESS_KEY_ID", "AK"),
                ("AWS_SECRET_ACCESS_KEY", "s k"),
                ("AWS_REGION", "r1")
            ])
        );
        std::fs::write(&p, "AWS_ENDPONT_URL=http://x\n").unwrap();
        let e = read_settings_file(&p).unwrap_err();
        assert!(e.contains("AWS_ENDPONT_URL"), "{e}");
        std::fs::write(&p, "garbage\n").unwrap();
        assert!(read_settings_file(&p).is_err());
    }
}
