//! Addresses no broad allow range admits: loopback, link-local and unspecified addresses, and
//! Tailscale's own addresses inside its ranges. An `allow` range admits one of them only when the
//! range lies inside its block, i.e. names it on purpose: `127.0.0.0/8` admits 127.0.0.2, while
//! `0.0.0.0/0` or the default `100.64.0.0/10` admit neither 127.0.0.2 nor 100.100.100.100.
//!
//! Addresses are compared in canonical form: an IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) is the
//! IPv4 address it maps, and so is a mapped range.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Why an address is guarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressGuard {
    /// Loopback, link-local or unspecified: this machine or its link (cloud metadata lives at
    /// 169.254.169.254), never a remote node.
    Local,
    /// Inside Tailscale's ranges but no node's: its own service (100.100.100.100,
    /// fd7a:115c:a1e0::53: MagicDNS and the local web interface) and its reserved 100.115.92.0/23.
    Tailscale,
}

/// The guarded blocks.
fn blocks() -> [(IpNet, AddressGuard); 9] {
    let v4 = |a, b, c, d, len| IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len));
    let v6 = |addr: Ipv6Addr, len| IpNet::V6(Ipv6Net::new_assert(addr, len));
    [
        (v4(127, 0, 0, 0, 8), AddressGuard::Local),
        (v4(169, 254, 0, 0, 16), AddressGuard::Local),
        (v4(0, 0, 0, 0, 32), AddressGuard::Local),
        (v6(Ipv6Addr::LOCALHOST, 128), AddressGuard::Local),
        (
            v6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
            AddressGuard::Local,
        ),
        (v6(Ipv6Addr::UNSPECIFIED, 128), AddressGuard::Local),
        (v4(100, 100, 100, 100, 32), AddressGuard::Tailscale),
        (v4(100, 115, 92, 0, 23), AddressGuard::Tailscale),
        (
            v6(Ipv6Addr::new(0xfd7a, 0x115c, 0xa1e0, 0, 0, 0, 0, 0x53), 128),
            AddressGuard::Tailscale,
        ),
    ]
}

/// The guarded block `ip` (canonical) is in, if any.
fn block_of(ip: IpAddr) -> Option<(IpNet, AddressGuard)> {
    blocks().into_iter().find(|(block, _)| block.contains(&ip))
}

/// Why `ip` is guarded, if it is; `ip` in any form.
pub fn guard(ip: IpAddr) -> Option<AddressGuard> {
    block_of(ip.to_canonical()).map(|(_, guard)| guard)
}

/// `range` in canonical form: an IPv4-mapped IPv6 range is the IPv4 range it maps.
pub fn canonical_range(range: IpNet) -> IpNet {
    match range {
        IpNet::V6(net) if net.prefix_len() >= 96 => match net.network().to_ipv4_mapped() {
            Some(v4) => IpNet::V4(Ipv4Net::new_assert(v4, net.prefix_len() - 96)),
            None => range,
        },
        _ => range,
    }
}

/// Whether the allow range `range` (canonical) admits `ip` (any form): it holds the address, and when
/// the address is guarded the range lies inside its block.
pub fn range_admits(range: &IpNet, ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    range.contains(&ip) && block_of(ip).is_none_or(|(block, _)| block.contains(range))
}

/// Parses a node's address, `IP:port` or `[IPv6]:port` (a registration's, a pod annotation's).
pub fn parse_address(text: &str) -> Result<SocketAddr, String> {
    match text.parse::<SocketAddr>() {
        Ok(address) if address.port() != 0 => Ok(address),
        Ok(_) => Err(format!("{text:?} has port 0")),
        Err(_) => Err(format!(
            "{text:?} is not IP:port (like 100.101.102.103:8000 or [fd7a:115c:a1e0::1]:8000)"
        )),
    }
}
